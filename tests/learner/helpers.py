"""Shared fixtures of the learner tests: a tiny model, configs, synthetic batches, tree comparisons."""

import jax
import numpy as np
from flax import nnx

from configs import base
from sao_jax import config_lib
from sao_jax import parallel
from sao_jax.models import Decoder, get_model_config
from sao_jax.structs import Batch

VOCAB = 64
MODEL = get_model_config('tiny', vocab_size=VOCAB, embed_dim=32, mlp_dim=64, num_heads=4, num_kv_heads=2,
                         head_dim=8, num_layers=2)
B, T = 8, 16
# The SAO scenario: 2 minibatches of 4 rows (so K=2 critic epochs = 4 critic updates per step).
SAO_OVERRIDES = {'trainer.minibatch_size': 4, 'optim.max_consecutive_skips': 5}


def policy_fn(seed: int = 0):
  return lambda: Decoder(MODEL, rngs=nnx.Rngs(seed))


def config(algo: str = 'sao', **overrides):
  """A small-step config: both lrs 1e-3 (moves are visible), warmup 1 learner step."""
  c = base.get_config()
  c.algo.name = algo
  c.trainer.batch_size = B
  c.optim.actor_lr = 1e-3
  c.optim.critic_lr = 1e-3
  c.algo.critic_warmup_steps = 1
  if algo != 'sao':
    c.algo.group_size = 2
    c.algo.clip_mode = 'ppo'
    c.algo.eps_low = c.algo.eps_high = 0.2
  return config_lib.override(c, overrides)


def mesh(fsdp: int, tensor: int, devices=None):
  devices = jax.devices()[: fsdp * tensor] if devices is None else devices
  return parallel.make_mesh(dict(data=1, fsdp=fsdp, tensor=tensor), devices=devices)


def batch(seed: int = 0, rows: int = B, length: int = T, pad_rows: int = 1) -> Batch:
  """Prompt (4 tokens), action (5), observation (2), action (3), then padding; row 1 truncated, the last
  `pad_rows` rows padding; rows (2i, 2i+1) form group i.

  Rewards 0/1 on the last action token; behaviour log-probs near the tiny model's (about -log V).
  """
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, VOCAB, (rows, length)).astype(np.int32)
  am = np.zeros((rows, length), np.float32)
  am[:, 4:9] = 1
  am[:, 11:14] = 1
  tokens[:, 14:] = 0
  rewards = np.zeros((rows, length), np.float32)
  rewards[:, 13] = rng.integers(0, 2, rows)
  blp = (-np.log(VOCAB) + 0.1 * rng.standard_normal((rows, length))).astype(np.float32) * am
  truncated = np.zeros(rows, bool)
  truncated[1] = True
  row_mask = np.ones(rows, np.float32)
  row_mask[rows - pad_rows:] = 0
  return Batch.from_rows(tokens=tokens, action_mask=am, behavior_logprobs=blp, rewards=rewards,
                         lengths=np.full(rows, 14), truncated=truncated,
                         group_ids=(np.arange(rows) // 2).astype(np.int32), row_mask=row_mask)


def whole_rows(batch: Batch) -> Batch:
  """`batch` with every row one real trajectory filling it (after replacing tokens of every row)."""
  rows, t = batch.shape
  return batch.replace(segment_ids=np.ones((rows, t), np.int32), segment_mask=np.ones((rows, 1), np.float32),
                       truncated=np.zeros((rows, 1), bool))


def host(tree):
  return jax.tree.map(np.asarray, parallel.to_host(tree))


def leaves_with_paths(tree):
  return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(host(tree))}
