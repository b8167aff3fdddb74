"""A fake Google Cloud Storage in this process, for tests of `gs://` workdirs (no network, no credentials).

    with fake_gcs.installed() as root:   # gs://BUCKET/NAME is the file <root>/BUCKET/NAME
      trainer.run(config_with(workdir='gs://bucket/run'))

A run on `gs://` reaches the store by three clients, and each is pointed at the same objects (files under one local
root, with GCS's semantics: no directories, no appends, objects replaced whole):
- `etils.epath` (metrics, TensorBoard, the path checks; orbax's JSON items and commit files) through fsspec: either
  `FakeGcsFileSystem`, registered for the `gs`/`gcs` protocols in place of gcsfs (`installed('fake')`), or the real
  gcsfs over HTTP to the server below (`installed('gcsfs')`, `STORAGE_EMULATOR_HOST`);
- tensorstore (orbax's arrays), which has its own GCS driver (`TENSORSTORE_GCS_HTTP_URL`), and google-cloud-storage
  (orbax asks it whether a bucket has a hierarchical namespace; `STORAGE_EMULATOR_HOST`): both speak GCS's JSON API
  over HTTP, to `FakeGcsServer` on 127.0.0.1.
The server serves what these clients use: bucket metadata, object metadata, downloads (byte ranges), media,
multipart and resumable uploads, deletes (one, or a batch) and listings, with generations and the
`ifGenerationMatch` / `ifGenerationNotMatch` preconditions tensorstore's OCDBT relies on.
"""
from __future__ import annotations

import contextlib
import datetime
import http.server
import importlib
import io
import itertools
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from urllib import parse

import fsspec
from etils.epath import backend as epath_backend

fsspec_registry = importlib.import_module('fsspec.registry')  # The module (`fsspec.registry` is its mapping).


class FakeGcsStore:
  """Objects as files under `root` (`<root>/<bucket>/<name>`), each with a generation."""

  def __init__(self, root: str):
    self.root = root
    self._uploads = tempfile.mkdtemp(prefix='fake_gcs_uploads_')  # Partial uploads: never visible as objects.
    self._generations: dict[str, int] = {}
    self.lock = threading.RLock()

  def file(self, bucket: str, name: str) -> str:
    return os.path.join(self.root, bucket, *name.split('/'))

  def generation(self, bucket: str, name: str) -> int:
    """The object's generation (0 = no such object)."""
    path = self.file(bucket, name)
    with self.lock:
      if not os.path.isfile(path):
        return 0
      return self._generations.get(path) or os.stat(path).st_mtime_ns

  def put(self, bucket: str, name: str, data: bytes) -> int:
    """Writes the object whole (readers see the old or the new one); returns its new generation."""
    path = self.file(bucket, name)
    fd, tmp = tempfile.mkstemp(dir=self._uploads)
    with os.fdopen(fd, 'wb') as f:
      f.write(data)
    return self.commit(tmp, path)

  def commit(self, tmp: str, path: str) -> int:
    with self.lock:
      os.makedirs(os.path.dirname(path), exist_ok=True)
      os.replace(tmp, path)
      gen = max(time.time_ns(), self._generations.get(path, 0) + 1)
      self._generations[path] = gen
      return gen

  def delete(self, bucket: str, name: str) -> None:
    path = self.file(bucket, name)
    with self.lock:
      os.remove(path)
      self._generations.pop(path, None)
      _prune(os.path.dirname(path), os.path.join(self.root, bucket))

  def names(self, bucket: str, prefix: str = '') -> list[str]:
    """Every object name of `bucket` starting with `prefix`, sorted."""
    top = os.path.join(self.root, bucket)
    out = []
    for dirpath, _, files in os.walk(top):
      for f in files:
        name = os.path.relpath(os.path.join(dirpath, f), top).replace(os.sep, '/')
        if name.startswith(prefix):
          out.append(name)
    return sorted(out)

  def metadata(self, bucket: str, name: str) -> dict:
    st = os.stat(self.file(bucket, name))
    updated = datetime.datetime.fromtimestamp(st.st_mtime, datetime.timezone.utc).isoformat().replace('+00:00', 'Z')
    return {'kind': 'storage#object', 'id': f'{bucket}/{name}', 'name': name, 'bucket': bucket,
            'generation': str(self.generation(bucket, name)), 'metageneration': '1', 'size': str(st.st_size),
            'contentType': 'application/octet-stream', 'storageClass': 'STANDARD', 'timeCreated': updated,
            'updated': updated}

def _prune(path: str, stop: str) -> None:
  """Removes empty directories from `path` up to (not including) `stop`: a prefix with no object is nothing."""
  while os.path.abspath(path).startswith(os.path.abspath(stop) + os.sep):
    try:
      os.rmdir(path)
    except OSError:
      return
    path = os.path.dirname(path)


# ------------------------------------------------------------------------------------------------------------
# fsspec: what etils.epath uses for gs://.


class _Upload(io.FileIO):
  """A file being written: the object appears (whole) when it is closed."""

  def __init__(self, store: FakeGcsStore, path: str):
    fd, self._tmp = tempfile.mkstemp(dir=store._uploads)  # pylint: disable=protected-access
    os.close(fd)
    super().__init__(self._tmp, 'wb')
    self._store, self._path = store, path

  def close(self) -> None:
    if self.closed:
      return
    super().close()
    self._store.commit(self._tmp, self._path)


class FakeGcsFileSystem(fsspec.AbstractFileSystem):
  """gcsfs's behaviour over a `FakeGcsStore`: paths `bucket/name`, directories implied by the objects under
  them, `mkdir` a no-op, writes visible at close, no append (gcsfs would silently overwrite; here it raises)."""

  protocol = ('gs', 'gcs')
  root_marker = ''
  cachable = False
  store: FakeGcsStore | None = None  # Set by `installed()`.

  def __init__(self, *args, **kwargs):
    del args, kwargs  # (gcsfs's options, e.g. finalize_on_close.)
    super().__init__()

  def _split(self, path: str) -> tuple[str, str]:
    path = self._strip_protocol(path)
    bucket, _, name = path.partition('/')
    return bucket, name.strip('/')

  def _local(self, path: str) -> str:
    bucket, name = self._split(path)
    return self.store.file(bucket, name) if name else os.path.join(self.store.root, bucket)

  def _has_objects(self, local: str) -> bool:
    return any(files for _, _, files in os.walk(local))

  def info(self, path, **kwargs):
    bucket, name = self._split(path)
    local = self._local(path)
    full = self._strip_protocol(path)
    if name and os.path.isfile(local):
      meta = self.store.metadata(bucket, name)
      return {'name': full, 'size': int(meta['size']), 'type': 'file', 'generation': meta['generation']}
    if os.path.isdir(local) and (not name or self._has_objects(local)):
      return {'name': full, 'size': 0, 'type': 'directory'}
    raise FileNotFoundError(path)

  def ls(self, path, detail=True, **kwargs):
    info = self.info(path)
    if info['type'] == 'file':
      entries = [info]
    else:
      local = self._local(path)
      entries = []
      for child in sorted(os.listdir(local)):
        try:
          entries.append(self.info(f'{info["name"]}/{child}'))
        except FileNotFoundError:
          continue  # An empty directory left behind: no object under it, so nothing on GCS.
    return entries if detail else [e['name'] for e in entries]

  def _open(self, path, mode='rb', block_size=None, autocommit=True, cache_options=None, **kwargs):
    if 'a' in mode or '+' in mode:
      raise NotImplementedError(f'{path}: GCS objects cannot be appended to (mode {mode!r}).')
    local = self._local(path)
    if 'r' in mode:
      if not os.path.isfile(local):
        raise FileNotFoundError(path)
      return open(local, 'rb')
    return io.BufferedWriter(_Upload(self.store, local))

  def mkdir(self, path, create_parents=True, **kwargs):
    pass  # GCS has no directories.

  def makedirs(self, path, exist_ok=False):
    pass

  def rm_file(self, path):
    bucket, name = self._split(path)
    if os.path.isfile(self._local(path)):
      self.store.delete(bucket, name)
    # (A "directory" goes when its last object does.)

  def rmdir(self, path):
    if self.exists(path):
      raise OSError(f'{path} is not empty')

  def cp_file(self, path1, path2, **kwargs):
    with self.open(path1, 'rb') as fin, self.open(path2, 'wb') as fout:
      shutil.copyfileobj(fin, fout)

  def modified(self, path):
    return datetime.datetime.fromtimestamp(os.stat(self._local(path)).st_mtime, datetime.timezone.utc)

  created = modified


# ------------------------------------------------------------------------------------------------------------
# HTTP: GCS's JSON API, for tensorstore, google-cloud-storage and gcsfs.


class _Handler(http.server.BaseHTTPRequestHandler):
  protocol_version = 'HTTP/1.1'
  store: FakeGcsStore  # Set on the subclass `FakeGcsServer` makes.

  def log_message(self, *args):  # Quiet.
    pass

  def _body(self) -> bytes:
    if self.headers.get('Transfer-Encoding', '').lower() == 'chunked':
      out = b''
      while True:
        size = int(self.rfile.readline().strip().split(b';')[0], 16)
        if not size:
          self.rfile.readline()
          return out
        out += self.rfile.read(size)
        self.rfile.readline()
    return self.rfile.read(int(self.headers.get('Content-Length') or 0))

  def _send(self, code: int, body: bytes = b'', headers: dict[str, str] | None = None,
            content_type: str = 'application/json') -> None:
    self.send_response(code)
    for k, v in (headers or {}).items():
      self.send_header(k, v)
    if code != 304 and code != 204:
      self.send_header('Content-Type', content_type)
    self.send_header('Content-Length', str(len(body)))
    self.end_headers()
    if body:
      self.wfile.write(body)

  def _json(self, code: int, obj: dict) -> None:
    self._send(code, json.dumps(obj).encode())

  def _error(self, code: int, message: str) -> None:
    self._json(code, {'error': {'code': code, 'message': message, 'errors': [{'message': message}]}})

  def _route(self) -> tuple[str, str | None, str | None, dict[str, str]]:
    """(kind, bucket, object name, query): kind 'bucket', 'list', 'object' or 'upload'."""
    url = parse.urlsplit(self.path)
    query = {k: v[-1] for k, v in parse.parse_qs(url.query, keep_blank_values=True).items()}
    parts = url.path.split('/')
    if parts[1] == 'download':  # (gcsfs's media downloads.)
      parts = parts[:1] + parts[2:]
    if parts[1:4] == ['upload', 'storage', 'v1'] and len(parts) >= 7 and parts[6] == 'o':
      return 'upload', parse.unquote(parts[5]), query.get('name'), query
    if parts[1:3] == ['storage', 'v1'] and len(parts) >= 5 and parts[3] == 'b':
      bucket = parse.unquote(parts[4])
      if len(parts) == 5:
        return 'bucket', bucket, None, query
      if len(parts) == 6 and parts[5] == 'o':
        return 'list', bucket, None, query
      if len(parts) >= 7 and parts[5] == 'o':
        return 'object', bucket, parse.unquote('/'.join(parts[6:])), query
    return 'unknown', None, None, query

  def _precondition(self, gen: int, query: dict[str, str]) -> int | None:
    """The error code a request's preconditions give (None: they hold)."""
    if 'ifGenerationMatch' in query and int(query['ifGenerationMatch']) != gen:
      return 412
    if 'ifGenerationNotMatch' in query and int(query['ifGenerationNotMatch']) == gen:
      return 304
    return None

  def do_GET(self):  # pylint: disable=invalid-name
    kind, bucket, name, query = self._route()
    self._body()
    if kind == 'bucket':
      return self._json(200, {'kind': 'storage#bucket', 'id': bucket, 'name': bucket, 'location': 'US',
                              'storageClass': 'STANDARD', 'metageneration': '1'})
    if kind == 'list':
      return self._list(bucket, query)
    if kind != 'object':
      return self._error(404, f'unknown path {self.path}')
    with self.store.lock:
      gen = self.store.generation(bucket, name)
      if not gen:
        return self._error(404, f'No such object: {bucket}/{name}')
      code = self._precondition(gen, query)
      if code:
        return self._send(code, headers={'x-goog-generation': str(gen)}) if code == 304 else \
            self._error(code, 'Precondition Failed')
      if query.get('alt') != 'media':
        return self._json(200, self.store.metadata(bucket, name))
      with open(self.store.file(bucket, name), 'rb') as f:
        data = f.read()
    headers = {'x-goog-generation': str(gen), 'x-goog-metageneration': '1'}
    rng = self.headers.get('Range')
    if not rng:
      return self._send(200, data, headers, 'application/octet-stream')
    start, _, stop = rng.split('=', 1)[1].partition('-')
    if not start:
      start, stop = max(0, len(data) - int(stop)), len(data) - 1
    else:
      start, stop = int(start), min(int(stop) if stop else len(data) - 1, len(data) - 1)
    if start >= len(data) and len(data):
      return self._error(416, 'Requested range not satisfiable')
    headers['Content-Range'] = f'bytes {start}-{stop}/{len(data)}'
    return self._send(206, data[start:stop + 1], headers, 'application/octet-stream')

  def _list(self, bucket: str, query: dict[str, str]) -> None:
    prefix, delimiter = query.get('prefix', ''), query.get('delimiter', '')
    names = [n for n in self.store.names(bucket, prefix)
             if n >= query.get('startOffset', '') and (not query.get('endOffset') or n < query['endOffset'])
             and n > query.get('pageToken', '')]
    items, prefixes = [], set()
    for n in names:
      if delimiter and delimiter in n[len(prefix):]:
        prefixes.add(n[:len(prefix) + n[len(prefix):].index(delimiter) + len(delimiter)])
      else:
        items.append(n)
    out = {'kind': 'storage#objects'}
    limit = int(query.get('maxResults') or 1000)
    if len(items) > limit and not delimiter:
      items = items[:limit]
      out['nextPageToken'] = items[-1]
    if items:
      out['items'] = [self.store.metadata(bucket, n) for n in items]
    if prefixes:
      out['prefixes'] = sorted(prefixes)
    return self._json(200, out)

  def do_POST(self):  # pylint: disable=invalid-name
    kind, bucket, name, query = self._route()
    data = self._body()
    if _urlpath(self.path) == '/batch/storage/v1':
      return self._batch(data)
    if kind != 'upload':
      return self._error(501, f'fake GCS: not served: POST {self.path}')
    upload_type = query.get('uploadType')
    if upload_type == 'multipart':  # (gcsfs: small files.) Part 1 the object's JSON metadata, part 2 its bytes.
      meta, data = _multipart(self.headers['Content-Type'], data)
      name = json.loads(meta).get('name', name)
    elif upload_type == 'resumable' and 'upload_id' not in query:  # (gcsfs: a session, then chunks.)
      name = name or json.loads(data or b'{}').get('name')
      upload_id = str(next(_SESSION_IDS))
      _SESSIONS[upload_id] = {'bucket': bucket, 'name': name, 'query': query, 'data': bytearray()}
      location = (f'http://{self.headers["Host"]}/upload/storage/v1/b/{parse.quote(bucket)}/o'
                  f'?uploadType=resumable&upload_id={upload_id}')
      return self._send(200, b'', {'Location': location})
    elif upload_type == 'resumable':
      return self._chunk(query['upload_id'], data)
    elif upload_type != 'media' or not name:
      return self._error(501, f'fake GCS: not served: POST {self.path}')
    return self._put(bucket, name, data, query)

  do_PUT = do_POST  # (Resumable chunks may come by PUT.)

  def _put(self, bucket: str, name: str, data: bytes, query: dict[str, str]) -> None:
    with self.store.lock:
      if self._precondition(self.store.generation(bucket, name), query):
        return self._error(412, 'Precondition Failed')
      self.store.put(bucket, name, data)
      return self._json(200, self.store.metadata(bucket, name))

  def _chunk(self, upload_id: str, data: bytes) -> None:
    """One chunk of a resumable upload (`Content-Range: bytes a-b/total`, total '*' until the last)."""
    session = _SESSIONS[upload_id]
    session['data'] += data
    total = self.headers.get('Content-Range', 'bytes */*').rsplit('/', 1)[1]
    if total != '*' and int(total) == len(session['data']):
      del _SESSIONS[upload_id]
      return self._put(session['bucket'], session['name'], bytes(session['data']), session['query'])
    n = len(session['data'])
    return self._send(308, b'', {'Range': f'bytes=0-{n - 1}'} if n else {})

  def _batch(self, body: bytes) -> None:
    """A batch of deletes (gcsfs's `rm`), answered part by part."""
    boundary = 'batch_fake_gcs'
    out = []
    for line in body.decode().splitlines():
      if not line.startswith('DELETE /storage/v1/b/'):
        continue
      _, bucket, _, name = line.split()[1].split('?')[0].split('/', 6)[3:7]
      bucket, name = parse.unquote(bucket), parse.unquote(name)
      with self.store.lock:
        found = bool(self.store.generation(bucket, name))
        if found:
          self.store.delete(bucket, name)
      status = 'HTTP/1.1 204 No Content' if found else 'HTTP/1.1 404 Not Found'
      out.append(f'--{boundary}\nContent-Type: application/http\n\n{status}\n\n')
    body = (''.join(out) + f'--{boundary}--').encode()
    return self._send(200, body, content_type=f'multipart/mixed; boundary={boundary}')

  def do_DELETE(self):  # pylint: disable=invalid-name
    kind, bucket, name, query = self._route()
    self._body()
    if kind != 'object':
      return self._error(404, f'unknown path {self.path}')
    with self.store.lock:
      gen = self.store.generation(bucket, name)
      if not gen:
        return self._error(404, f'No such object: {bucket}/{name}')
      if self._precondition(gen, query):
        return self._error(412, 'Precondition Failed')
      self.store.delete(bucket, name)
    return self._send(204)


_SESSIONS: dict[str, dict] = {}  # Resumable uploads in progress.
_SESSION_IDS = itertools.count(1)


def _urlpath(url: str) -> str:
  return parse.urlsplit(url).path


def _multipart(content_type: str, body: bytes) -> tuple[bytes, bytes]:
  """The two parts (metadata, data) of a `multipart/related` upload."""
  boundary = content_type.split('boundary=', 1)[1].strip('"').encode()
  parts = body.split(b'--' + boundary)[1:3]
  out = []
  for part in parts:
    sep = b'\r\n\r\n' if b'\r\n\r\n' in part else b'\n\n'
    content = part.split(sep, 1)[1]
    out.append(content[:-2] if content.endswith(b'\r\n') else content[:-1] if content.endswith(b'\n') else content)
  return out[0], out[1]


class FakeGcsServer:
  """GCS's JSON API on 127.0.0.1 (a free port) over `store`, served by a daemon thread until `close()`."""

  def __init__(self, store: FakeGcsStore):
    handler = type('Handler', (_Handler,), {'store': store})
    self._server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), handler)
    self._server.daemon_threads = True
    self.url = f'http://127.0.0.1:{self._server.server_address[1]}'
    self._thread = threading.Thread(target=self._server.serve_forever, name='fake-gcs', daemon=True)
    self._thread.start()

  def close(self) -> None:
    self._server.shutdown()
    self._server.server_close()


# ------------------------------------------------------------------------------------------------------------
# Installing it.


def _clear_caches() -> None:
  epath_backend.fsspec_backend._get_filesystem.cache_clear()  # pylint: disable=protected-access
  try:
    import gcsfs  # pylint: disable=g-import-not-at-top
    gcsfs.GCSFileSystem.clear_instance_cache()  # (An instance keeps the endpoint and its listings.)
  except ImportError:
    pass
  try:
    from orbax.checkpoint._src.path import gcs_utils  # pylint: disable=g-import-not-at-top
    gcs_utils.get_bucket.cache_clear()
  except ImportError:
    pass


_SERVER: FakeGcsServer | None = None
_STORE: FakeGcsStore | None = None


@contextlib.contextmanager
def installed(client: str = 'fake') -> Iterator[str]:
  """Routes every `gs://` client of this process to a fresh, empty fake store; yields its root (objects are the
  files `<root>/<bucket>/<name>`). One server serves the whole process (tensorstore may keep the first
  `TENSORSTORE_GCS_HTTP_URL` it read); each block gets its own root.

  Args:
    client: what etils.epath's fsspec reaches the store with: 'fake' (`FakeGcsFileSystem`, in process) or
      'gcsfs' (the real client, over HTTP to the server, as on a pod).
  """
  global _SERVER, _STORE
  if _SERVER is None:
    _STORE = FakeGcsStore(tempfile.mkdtemp(prefix='fake_gcs_'))
    _SERVER = FakeGcsServer(_STORE)
  root = _STORE.root = tempfile.mkdtemp(prefix='fake_gcs_')
  env = {'TENSORSTORE_GCS_HTTP_URL': _SERVER.url, 'STORAGE_EMULATOR_HOST': _SERVER.url,
         'GOOGLE_AUTH_TOKEN_FOR_TESTING': 'fake', 'GOOGLE_CLOUD_PROJECT': 'fake-project'}
  saved_env = {k: os.environ.get(k) for k in env}
  registered = fsspec_registry._registry  # pylint: disable=protected-access
  saved_fs = {p: registered.get(p) for p in FakeGcsFileSystem.protocol}
  os.environ.update(env)
  FakeGcsFileSystem.store = _STORE
  if client == 'fake':
    for p in FakeGcsFileSystem.protocol:
      fsspec.register_implementation(p, FakeGcsFileSystem, clobber=True)
  elif client != 'gcsfs':
    raise ValueError(f'client={client!r}: fake or gcsfs')
  _clear_caches()
  try:
    yield root
  finally:
    for p, cls in saved_fs.items():
      registered.pop(p, None)
      if cls is not None:
        fsspec.register_implementation(p, cls, clobber=True)
    for k, v in saved_env.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v
    _clear_caches()
    FakeGcsFileSystem.store = None
    shutil.rmtree(root, ignore_errors=True)
