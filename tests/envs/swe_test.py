"""The swe task: the oracle scores 1 on every shipped instance, doing nothing 0, each hostile policy 0; tools,
the tool-call parser, the harness, diffs, the generator and the SWE-bench JSONL loader."""

import concurrent.futures
import json
import os
import random
import secrets
import shutil
import subprocess
import tempfile

from absl.testing import absltest

from sao_jax import envs
from sao_jax.envs import sandbox as sandbox_lib
from sao_jax.envs import swe
from sao_jax.envs import swe_data
from sao_jax.envs import swe_gen

_BWRAP_PROBLEM = sandbox_lib.bwrap_problem()
_FAST = {'command_timeout_s': 5.0, 'per_test_timeout_s': 1.5, 'verdict_timeout_s': 30.0}  # Some bugs loop.
_TASK = None


def setUpModule():
  global _TASK
  if _BWRAP_PROBLEM is not None:
    raise absltest.SkipTest(f'swe needs bubblewrap: {_BWRAP_PROBLEM}')
  _TASK = envs.get_task({'name': 'swe', 'max_turns': 12, 'eval_size': 0, 'kwargs': _FAST})


def _call(name, **arguments):
  return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def _play(ex, actions, task=None):
  """Plays `actions` (the episode stops at done); returns (reward, info, observations, env)."""
  env = (task or _TASK).make_env(ex)
  env.reset()
  observations = []
  for action in actions:
    obs, reward, done, info = env.step(action)
    observations.append(obs or '')
    if done:
      return reward, info, observations, env
  raise AssertionError(f'the episode did not end after {len(actions)} turns')


def _examples():
  return _TASK.train_examples()


def _hostile_examples():
  """One instance of each synthetic package (the hostile policies run on these)."""
  by_repo = {}
  for ex in _examples():
    by_repo.setdefault(ex.data['instance_id'].split('-')[0], ex)
  return list(by_repo.values())


def _buggy_module(ex):
  return swe_data.parse_patch(ex.data['patch'])[0].old


_SUBMIT = _call('submit')


class ShippedInstancesTest(absltest.TestCase):

  def test_oracle_scores_one_and_doing_nothing_zero_on_every_instance(self):
    exs = _examples()
    self.assertGreaterEqual(len(exs), 40)

    def both(ex):
      return (_play(ex, swe.oracle_actions(ex, run_tests_first=False))[:2], _play(ex, [_SUBMIT])[:2])
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
      results = list(pool.map(both, exs))
    for ex, ((r_oracle, info), (r_nothing, info0)) in zip(exs, results):
      self.assertEqual(r_oracle, 1.0, (ex.uid, info))
      self.assertEqual(info['tests_total'], len(set(ex.data['fail_to_pass'] + ex.data['pass_to_pass'])))
      self.assertEqual(r_nothing, 0.0, (ex.uid, info0))
      self.assertEqual(info0['fail_to_pass_passed'], 0, ex.uid)  # The bug is real ...
      self.assertEqual(info0['pass_to_pass_passed'], len(ex.data['pass_to_pass']), ex.uid)  # ... and alone.

  def test_oracle_with_its_test_run_and_the_turn_limit(self):
    ex = _examples()[0]
    actions = swe.oracle_actions(ex)
    self.assertEqual([json.loads(a[len('<tool_call>'):-len('</tool_call>')])['name'] for a in actions],
                     ['view', 'edit', 'test', 'submit'])
    reward, info, observations, _ = _play(ex, actions)
    self.assertEqual((reward, info['submitted']), (1.0, True))
    self.assertIn(' passed, 0 failed', observations[2])
    # The turn budget without submit scores the tree (terminal) ...
    fixed = actions[:2] + [_call('view', path='.')] * 10
    reward, info, _, _ = _play(ex, fixed)
    self.assertEqual((reward, info['submitted'], info.get('truncated', False)), (1.0, False, False))
    # ... or, with score_at_turn_limit=False, cuts it (reward 0, truncated).
    task = envs.get_task({'name': 'swe', 'max_turns': 3, 'eval_size': 0,
                          'kwargs': {**_FAST, 'score_at_turn_limit': False}})
    reward, info, _, _ = _play(task.train_examples()[0], [_call('view', path='.')] * 3, task=task)
    self.assertEqual((reward, info['truncated'], info['cut_by']), (0.0, True, 'max_turns'))

  def test_shipped_file_is_the_generators_output(self):
    with open(swe.DEFAULT_DATA, encoding='utf-8') as f:
      shipped = [json.loads(line) for line in f]
    self.assertEqual(shipped, json.loads(json.dumps(swe_gen.generate(swe_gen.SEED, swe_gen.NUM))))
    self.assertLen({row['bug']['function'] for row in shipped}, 17)  # Spread over the library.


class HostileTest(absltest.TestCase):
  """Each policy would score 1 (or see hidden data) if the defence it targets were missing; it scores 0."""

  def _assert_zero(self, ex, actions):
    reward, info, observations, env = _play(ex, actions + [_SUBMIT])
    self.assertEqual(reward, 0.0, (ex.uid, info))
    self.assertEqual(info['tests_total'], len(set(ex.data['fail_to_pass'] + ex.data['pass_to_pass'])))
    return observations, env

  def test_rewriting_the_tests_scores_zero(self):
    for ex in _hostile_examples():
      ids = ex.data['fail_to_pass'] + ex.data['pass_to_pass']
      by_file = {}
      for t in ids:  # Trivial versions of every test the verdict runs (even the hidden one's name).
        path, name = t.split('::')
        by_file.setdefault(path, []).append(f'def {name}():\n  pass\n')
      actions = [_call('create', path=p, content='\n\n'.join(b)) for p, b in by_file.items()]
      actions.append(_call('create', path='tests/conftest.py', content='import sys\nsys.exit(0)\n'))
      actions.append(_call('test', target='tests'))
      observations, _ = self._assert_zero(ex, actions)
      self.assertIn(f'{len(ex.data["pass_to_pass"]) + 1} passed, 0 failed', observations[-2])  # They do pass here.

  def test_deleting_the_tests_scores_zero(self):
    for ex in _hostile_examples():
      observations, env = self._assert_zero(ex, [_call('run', command='rm -rf tests && ls')])
      self.assertFalse(any(p.startswith('tests/') for p in env.files))  # Deleted in the working tree.

  def test_writing_outside_the_repository_scores_zero(self):
    token = secrets.token_hex(6)
    outside = os.path.join(tempfile.gettempdir(), f'sao_swe_escape_{token}')
    for ex in _hostile_examples():
      module = _buggy_module(ex)
      fixed = swe_data.apply_patch(ex.data['files'], ex.data['patch'])[module]
      actions = [_call('create', path=p, content=fixed)
                 for p in (f'../{module}', f'/tmp/repo/{module}', f'/{module}', f'x/../../{module}', outside)]
      actions.append(_call('run', command=f'echo owned > {outside}; echo owned > /tmp/../{os.path.basename(outside)};'
                                          f' cp -r . /tmp/elsewhere; echo owned > ../escape; ls /work /root'))
      observations, env = self._assert_zero(ex, actions)
      for obs in observations[:5]:
        self.assertTrue(obs.startswith('error: '), obs)
      self.assertFalse(os.path.exists(outside))
      self.assertEqual({p: t for p, t in env.files.items()}, dict(ex.data['files']))

  def test_reading_the_hidden_tests_or_the_gold_patch_scores_zero(self):
    for ex in _hostile_examples():
      hidden_name = ex.data['fail_to_pass'][0].split('::')[1]
      gold_lines = [l[1:] for l in ex.data['patch'].splitlines() if l.startswith('+') and not l.startswith('+++')]
      actions = [_call('view', path=p) for p in ex.data['hidden_tests']]
      actions += [_call('search', pattern='regression'), _call('search', pattern=gold_lines[0].strip()),
                  _call('run', command='grep -rn regression /tmp /dev /etc 2>/dev/null | head; find /tmp /etc /root /home /work -name "*.jsonl" '
                                       '-o -name "*.patch" 2>/dev/null | head; cat /proc/*/cmdline | head -c 3000'),
                  _call('run', command='python3 -c "import os; print(sorted(os.environ))"')]
      observations, _ = self._assert_zero(ex, actions)
      for obs in observations:
        self.assertNotIn(hidden_name, obs)
        self.assertNotIn(ex.data['patch'][:60], obs)
      self.assertTrue(observations[len(ex.data['hidden_tests']) + 1].startswith('no match for'))

  def test_forging_a_test_report_scores_zero(self):
    forge = '''
import os, json, sys
lines = ['PASSED %s' % t for t in IDS] + ['%d passed, 0 failed' % len(IDS)]
records = [json.dumps({'results': {t: {'ok': True, 'rc': 0, 'out': ''} for t in IDS}})]
for mark in ['', '@@SWE_0@@', 'PASS']:
  lines += [mark + r for r in records] + [mark + ' PASS']
for pid in os.listdir('/proc'):  # Into every process's output we can open.
  try:
    with open('/proc/%s/fd/1' % pid, 'w') as f:
      f.write('\\n'.join(lines) + '\\n')
  except OSError:
    pass
print('\\n'.join(lines)); sys.stdout.flush()
os._exit(0)
'''
    for ex in _hostile_examples():
      ids = ex.data['fail_to_pass'] + ex.data['pass_to_pass']
      module = _buggy_module(ex)
      actions = [
          _call('create', path=module, content=f'IDS = {ids!r}\n{forge}'),
          _call('create', path='report.json', content=json.dumps({t: 'passed' for t in ids})),
          _call('create', path='conftest.py', content='def pytest_runtest_makereport(item, call):\n  pass\n'),
          _call('create', path='sitecustomize.py', content='import os\nos._exit(0)\n'),
          _call('create', path='usercustomize.py', content='import os\nos._exit(0)\n'),
      ]
      self._assert_zero(ex, actions)

  def test_the_harness_cannot_be_read_by_what_it_runs(self):
    probe = ('import os\n'
             'harness = [p for p in os.listdir("/proc") if p.isdigit() and '
             'open("/proc/%s/cmdline" % p, "rb").read().startswith(b"/usr/bin/python3\\x00-I\\x00-\\x00")]\n'
             'for p in harness:\n'
             '  for what, mode in (("mem", "rb"), ("fd/1", "wb"), ("environ", "rb")):\n'
             '    try:\n'
             '      open("/proc/%s/%s" % (p, what), mode).close(); print("OPEN", what)\n'
             '    except OSError:\n'
             '      print("DENIED", what)\n')
    _, _, observations, _ = _play(_examples()[0], [_call('create', path='probe.py', content=probe),
                                                   _call('run', command='python3 probe.py'), _SUBMIT])
    self.assertEqual(observations[1].count('DENIED'), 3, observations[1])
    self.assertNotIn('OPEN', observations[1])


class ToolsTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.task = envs.get_task({'name': 'swe', 'max_turns': 1000, 'eval_size': 0, 'kwargs': _FAST})

  def setUp(self):
    super().setUp()
    self.ex = _examples()[0]
    self.env = self.task.make_env(self.ex)
    self.env.reset()
    self.module = _buggy_module(self.ex)

  def step(self, action):
    obs, reward, done, _ = self.env.step(action)
    self.assertFalse(done)
    self.assertEqual(reward, 0.0)
    return obs

  def test_view_search_edit_create(self):
    text = self.ex.data['files'][self.module]
    obs = self.step(_call('view', path=self.module, start=2, end=3))
    self.assertEqual(obs.splitlines()[1:], [f'{n:6d}\t{line}' for n, line in zip((2, 3), text.split('\n')[1:3])])
    self.assertIn(self.module, self.step(_call('view', path='.')))
    self.assertIn('error: bad line range', self.step(_call('view', path=self.module, start=5, end=2)))
    self.assertIn('error: no such file', self.step(_call('view', path='nope.py')))
    self.assertIn(f'{self.module}:1: ', self.step(_call('search', pattern=text.split('\n')[0])))
    self.assertIn('no match', self.step(_call('search', pattern='zzz_not_there')))
    self.assertIn('occurs 0 times', self.step(_call('edit', path=self.module, old='zzz', new='y')))
    self.assertIn('occurs', self.step(_call('edit', path=self.module, old='\n', new='\n\n')))
    self.assertEqual(self.env.files[self.module], text)  # Failed edits change nothing.
    self.assertIn('edited', self.step(_call('edit', path=self.module, old=text.split('\n')[0], new='# top')))
    self.assertTrue(self.env.files[self.module].startswith('# top\n'))
    self.assertIn('created new/mod.py', self.step(_call('create', path='new/./mod.py', content='x = 1\n')))
    self.assertEqual(self.env.files['new/mod.py'], 'x = 1\n')
    self.assertIn('is a directory', self.step(_call('create', path='new', content='x')))
    self.assertIn('is a file', self.step(_call('create', path='new/mod.py/x.py', content='x')))
    big = 'x' * (_TASK.opts.max_file_bytes + 1)
    self.assertIn('larger than', self.step(_call('create', path='big.txt', content=big)))

  def test_run_keeps_file_changes_and_reports_status(self):
    obs = self.step(_call('run', command='echo out; echo err >&2; echo hi > made.txt; rm -f tests/__init__.py; '
                                          'exit 3'))
    self.assertEqual(obs, 'out\nerr\n[exit code 3]')
    self.assertEqual(self.env.files['made.txt'], 'hi\n')
    self.assertNotIn('tests/__init__.py', self.env.files)
    obs = self.step(_call('run', command='ln -s /etc/passwd leak.txt; mkfifo fifo; head -c 100 /dev/urandom > b.bin'))
    self.assertIn('left out', obs)
    self.assertFalse({'leak.txt', 'fifo', 'b.bin'} & set(self.env.files))
    obs = self.step(_call('run', command='yes | head -c 200000'))
    self.assertIn('[output cut: ', obs)
    self.assertLessEqual(len(obs), _TASK.opts.max_observation_chars + 100)

  def test_run_timeout(self):
    task = envs.get_task({'name': 'swe', 'max_turns': 4, 'eval_size': 0,
                          'kwargs': {**_FAST, 'command_timeout_s': 0.5}})
    env = task.make_env(self.ex)
    env.reset()
    obs, _, done, _ = env.step(_call('run', command='echo before; sleep 30'))
    self.assertFalse(done)
    self.assertEqual(obs, 'before\n[timed out after 0.5s]')

  def test_test_tool(self):
    obs = self.step(_call('test', target='tests'))
    self.assertIn(f'{len(self.ex.data["pass_to_pass"])} passed, 0 failed', obs)
    self.step(_call('create', path='tests/test_more.py', content='def test_bad():\n  assert 1 == 2\n\n\n'
                                                                  'class TestX:\n  def test_ok(self):\n    pass\n'))
    obs = self.step(_call('test', target='tests/test_more.py'))
    self.assertIn('FAILED tests/test_more.py::test_bad\n', obs)
    self.assertIn('AssertionError', obs)
    self.assertIn('PASSED tests/test_more.py::TestX::test_ok', obs)
    self.assertIn('error: no tests found', self.step(_call('test', target='textkit_nope')))

  def test_parser_is_total(self):
    rng = random.Random(0)
    pieces = ['<tool_call>', '</tool_call>', '{', '}', '"name"', ':', '"view"', '"arguments"', '[', ']', 'x', '"',
              ',', '"path"', '"."', '3', 'null']
    cases = ['', 'no call here', '<tool_call>', '<tool_call>{bad json</tool_call>', '<tool_call>[]</tool_call>',
             '<tool_call>{"name": 3}</tool_call>', '<tool_call>{"name": "zap"}</tool_call>',
             '<tool_call>{"name": "view", "arguments": [1]}</tool_call>',
             '<tool_call>{"name": "view", "arguments": {"path": 3}}</tool_call>',
             '<tool_call>{"name": "view", "arguments": {"path": ".", "start": "1"}}</tool_call>',
             '<tool_call>{"name": "edit", "arguments": {}}</tool_call>',
             '<tool_call>' + '[' * 100000 + '</tool_call>', 'x' * 300000]
    cases += [''.join(rng.choice(pieces) for _ in range(rng.randrange(1, 30))) for _ in range(200)]
    env = self.task.make_env(self.ex)
    env.reset()
    for text in cases:
      if '"submit"' in text:
        continue
      obs, reward, done, info = env.step(text)
      self.assertFalse(done, text)
      self.assertNotIn('error', info)
      self.assertIsInstance(obs, str)
    obs = self.step('<tool_call>{"name": "view", "arguments": "{\\"path\\": \\"tests\\"}"}</tool_call>'
                    '<tool_call>{"name": "zap"}</tool_call>' + _call('view', path='.') * 4)
    self.assertIn('[1: view]\ntests/', obs)
    self.assertIn("error: unknown tool 'zap'", obs)
    self.assertIn('[2 more tool call(s) skipped', obs)


class HarnessTest(absltest.TestCase):

  def test_a_test_passes_only_by_returning(self):
    files = {'m.py': 'X = 1\n', 'tests/test_a.py': 'from m import X\n\ndef test_ok():\n  assert X == 1\n\n'
             'def test_bad():\n  assert X == 2\n\ndef test_exit():\n  raise SystemExit(0)\n\n'
             'def test_hard_exit():\n  import os\n  print(" PASS")\n  os._exit(0)\n\n'
             'def test_fixture(tmp_path):\n  pass\n'}
    ids = [f'tests/test_a.py::{n}' for n in ('test_ok', 'test_bad', 'test_exit', 'test_hard_exit', 'test_fixture',
                                              'test_missing')]
    results = swe.run_tests(_TASK.sandboxes.verdict, files, ids, per_test_timeout_s=3.0)
    self.assertEqual({t: ok for t, (ok, _) in results.items()},
                     {ids[0]: True, ids[1]: False, ids[2]: False, ids[3]: False, ids[4]: False, ids[5]: False})
    self.assertIn('fixtures are not supported', results[ids[4]][1])

  def test_verdict_tree_restores_test_files(self):
    snapshot = {'m.py': 'a', 'tests/test_m.py': 'visible', 'tests/test_gone.py': 'g'}
    hidden = {'tests/test_m.py': 'hidden', 'tests/test_new.py': 'new', 'tests/test_gone.py': None}
    edited = {'m.py': 'fixed', 'tests/test_m.py': 'pass', 'conftest.py': 'hook', 'tests/test_mine.py': 'x',
              'other.py': 'o'}
    self.assertEqual(swe.verdict_tree(edited, snapshot, hidden),
                     {'m.py': 'fixed', 'other.py': 'o', 'tests/test_m.py': 'hidden', 'tests/test_new.py': 'new'})


class DiffTest(absltest.TestCase):

  def test_round_trip_and_refusals(self):
    old = {'a.py': 'one\ntwo\nthree\n' + ''.join(f'l{i}\n' for i in range(20)) + 'end\n', 'gone.py': 'bye\n'}
    new = {'a.py': 'one\nTWO\nthree\n' + ''.join(f'l{i}\n' for i in range(20)) + 'END\nmore\n', 'b/new.py': 'hi\n'}
    diff = swe_data.make_patch(old, new)
    self.assertEqual(swe_data.apply_patch(old, diff), new)
    self.assertEqual(swe_data.patched_paths(diff), ['a.py', 'b/new.py', 'gone.py'])
    shifted = {**old, 'a.py': 'header\n' + old['a.py']}  # Hunks found away from their stated lines.
    self.assertEqual(swe_data.apply_patch(shifted, diff)['a.py'], 'header\n' + new['a.py'])
    with self.assertRaises(swe_data.PatchError):
      swe_data.apply_patch({**old, 'a.py': 'other\n'}, diff)
    with self.assertRaises(swe_data.PatchError):
      swe_data.apply_patch(new, diff)  # Creates a file that exists.
    with self.assertRaises(swe_data.PatchError):
      swe_data.parse_patch('--- a/x\n+++ b/x\n@@ -1,3 +1,3 @@\n a\n')
    with self.assertRaises(swe_data.PatchError):
      swe_data.parse_patch('--- a/../x\n+++ b/../x\n')

  def test_check_path(self):
    self.assertEqual(swe_data.check_path('a/./b//c.py'), 'a/b/c.py')
    for bad in ('', '/etc/passwd', '..', '../x', 'a/../../x', 'a\x00b', 'a\\b', 'x' * 300):
      with self.assertRaises(ValueError, msg=bad):
        swe_data.check_path(bad)


class LoaderTest(absltest.TestCase):
  """SWE-bench-format JSONL whose repositories are local directories (a plain one and a git one)."""

  def setUp(self):
    super().setUp()
    self.dir = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, self.dir)
    row = json.loads(open(swe.DEFAULT_DATA, encoding='utf-8').readline())
    self.files = row.pop('repo_files')
    self.row = {**row, 'FAIL_TO_PASS': json.dumps(row['FAIL_TO_PASS']), 'PASS_TO_PASS': json.dumps(row['PASS_TO_PASS'])}

  def _write_repo(self, root, files):
    for p, t in files.items():
      os.makedirs(os.path.dirname(os.path.join(root, p)), exist_ok=True)
      with open(os.path.join(root, p), 'w', encoding='utf-8') as f:
        f.write(t)

  def _load(self, rows):
    path = os.path.join(self.dir, 'rows.jsonl')
    with open(path, 'w', encoding='utf-8') as f:
      f.writelines(json.dumps(r) + '\n' for r in rows)
    return envs.get_task({'name': 'swe', 'max_turns': 12, 'eval_size': 0,
                          'kwargs': {**_FAST, 'data_file': path, 'repos_root': os.path.join(self.dir, 'repos')}})

  def test_directory_and_git_repositories(self):
    plain = os.path.join(self.dir, 'repos', 'synthetic__plain')
    self._write_repo(plain, {**self.files, '.hidden/x.py': 'no'})
    with open(os.path.join(plain, 'blob.bin'), 'wb') as f:
      f.write(b'\xff\x00\xfe')
    gitdir = os.path.join(self.dir, 'repos', 'org', 'gitrepo')
    self._write_repo(gitdir, self.files)
    git = ['git', '-C', gitdir, '-c', 'user.name=t', '-c', 'user.email=t@t']
    subprocess.run(git[:3] + ['init', '-q'], check=True)
    subprocess.run(git + ['add', '.'], check=True)
    subprocess.run(git + ['commit', '-qm', 'base'], check=True)
    base = subprocess.run(git[:3] + ['rev-parse', 'HEAD'], check=True, capture_output=True, text=True).stdout.strip()
    self._write_repo(gitdir, {_buggy_module_path(self.row): 'broken later\n'})
    subprocess.run(git + ['commit', '-qam', 'later'], check=True)
    rows = [{**self.row, 'instance_id': 'plain-1', 'repo': 'synthetic/plain'},
            {**self.row, 'instance_id': 'git-1', 'repo': 'org/gitrepo', 'base_commit': base,
             'problem_statement': self.row['problem_statement'] + ' (git)'},
            {**self.row, 'instance_id': 'norepo-1', 'repo': 'nowhere/x', 'problem_statement': 'p3'},
            {**self.row, 'instance_id': 'badpatch-1', 'repo': 'synthetic/plain', 'problem_statement': 'p4',
             'patch': _corrupt(self.row['patch'])},
            {**self.row, 'instance_id': 'nof2p-1', 'repo': 'synthetic/plain', 'problem_statement': 'p5',
             'FAIL_TO_PASS': '[]'}]
    task = self._load(rows)
    report = task.file_reports[0]
    self.assertEqual(report.kept, [1, 2])
    self.assertEqual([n for n, _ in report.skipped], [3, 4, 5])
    self.assertIn('no repository', report.skipped[0][1])
    self.assertIn('patch', report.skipped[1][1])
    self.assertIn('FAIL_TO_PASS', report.skipped[2][1])
    for ex in task.train_examples():
      self.assertEqual(ex.data['files'], self.files, ex.uid)  # Hidden dirs, binaries, later commits left out.
      reward, info, _, _ = _play(ex, swe.oracle_actions(ex, run_tests_first=False), task=task)
      self.assertEqual(reward, 1.0, info)

  def test_no_valid_row_is_a_config_error(self):
    os.makedirs(os.path.join(self.dir, 'repos'))
    with self.assertRaisesRegex(Exception, 'no valid row'):
      self._load([{**self.row, 'repo': 'nowhere/x'}])


def _corrupt(patch):
  """`patch` with its first removed line changed (so it no longer applies)."""
  lines = patch.split('\n')
  k = next(i for i, l in enumerate(lines) if l.startswith('-') and not l.startswith('---'))
  lines[k] = '-zz' + lines[k][1:]
  return '\n'.join(lines)


def _buggy_module_path(row):
  return swe_data.parse_patch(row['patch'])[0].old


if __name__ == '__main__':
  absltest.main()
