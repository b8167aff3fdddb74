"""What the HF parity tests share: transformers' logits, and our model's jitted forward and cached greedy decode."""

import jax.numpy as jnp
import numpy as np
from flax import nnx


def import_hf():
  """(torch, transformers), imported when a test module's tests run (heavy imports), torch on one thread."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  torch.set_num_threads(1)
  return torch, transformers


def hf_logits(model, tokens, mask=None):
  """A transformers model's logits (float32 numpy) on `tokens` [B, T] (with its attention `mask`, if given)."""
  import torch  # pylint: disable=g-import-not-at-top  (the tests that call this have it)
  with torch.no_grad():
    kw = {} if mask is None else {'attention_mask': torch.tensor(np.asarray(mask, np.int64))}
    return model(torch.tensor(np.asarray(tokens, np.int64)), **kw).logits.numpy()


@nnx.jit
def forward(model, tokens, mask):
  return model(tokens, attention_mask=mask)


@nnx.jit
def _step(model, tokens, cache):
  logits, cache = model(tokens, cache=cache)
  return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache


def greedy(model, prompt, n):
  """`n` greedy tokens [B, n] after `prompt` [B, T], through our model's KV cache."""
  cache = model.init_cache(prompt.shape[0], prompt.shape[1] + n)
  tok, cache = _step(model, prompt, cache)
  out = [tok]
  for _ in range(n - 1):
    tok, cache = _step(model, tok[:, None], cache)
    out.append(tok)
  return np.stack(out, axis=1)
