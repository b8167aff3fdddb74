"""An independent reference of ONE learner step (SAO and GRPO), written from the formulas of docs/design.md.

Nothing here uses the package's losses, advantages, learner or optimizer code: only the model classes
(`Decoder` for logits, `ValueModel.backbone.hidden` for the critic's hidden states) and `jax.grad` of
losses written below. Scalar work (returns, advantages, ratios, band, aggregation weights) is float64
numpy with plain Python loops; the models run in float32 (their compute dtype).

SAO (DESIGN "The algorithm", "Order inside one SAO step", "Contracts"), with plain SGD `p <- p - lr g`:

  v[b, t]      = w . h[b, t] + c                 critic output after token t (h: the backbone's hidden states)
  V[b, t]      = v[b, t - 1], V[b, 0] = 0        value of the state in which token t was generated
  bootstrap_b  = v[b, last real token] if truncated else 0   (the value of the state after the row's end)
  GAE over the action positions i_1 < ... < i_n of a row (observation tokens skipped):
    delta_k = r[i_k] + gamma V[i_{k+1}] - V[i_k]   (V[i_{n+1}] = bootstrap),   A_k = delta_k + gamma lam A_{k+1}
  returns      = GAE(lam = 1) + V, from the critic BEFORE its update (fixed)
  critic       K times: theta_c <- theta_c - lr_c grad mean_{action tokens} 0.5 (V - returns)^2
               (attention weights frozen: only the other parameters move)
  advantages   = GAE(lam_b = 1 - 1 / (alpha l_b)) with V from the UPDATED critic (l_b: action tokens of row b)
  logp[b, t]   = log_softmax(logits[b, t - 1] / T)[tokens[b, t]]   (T: the sampler's temperature)
  r            = exp(logp - behaviour log-probs),   f(r) = r if 1 - eps_low < r < 1 + eps_high else 0
  policy       theta <- theta - lr grad [-(1/N) sum_{action tokens} sg(f(r)) A logp],  N = all action tokens

GRPO: `R_b` = the row's reward, groups of G contiguous rows, `A_b = (R_b - mean_g R) / (std_g R + 1e-6)`
(std with Bessel's correction, as in GRPO's reference code), broadcast to the row's action tokens; PPO clip
`l = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)`, whose gradient w.r.t. logp is `-r A` except where the
ratio left the band on A's side (then 0); aggregated as a token mean (or a mean of row means).

Every choice can be switched to a known-wrong variant (`SaoVariant`, `GrpoVariant`) so that a test can show
how far each wrong algorithm lands from the learner's result.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

# The critic's frozen part under SAO: every parameter on a path through an attention block.
_ATTENTION = nnx.PathContains('attn')
CRITIC_TRAINED = nnx.All(nnx.Param, nnx.Not(_ATTENTION))


@dataclasses.dataclass(frozen=True)
class Settings:
  """The hyper-parameters the reference needs (the test sets the same ones in the learner's config)."""
  actor_lr: float
  critic_lr: float
  eps_low: float
  eps_high: float
  gamma: float = 1.0
  alpha: float = 1.5
  critic_epochs: int = 2
  group_size: int = 4
  group_eps: float = 1e-6
  temperature: float = 1.0  # The sampler's; the policy trained is softmax(logits / temperature).


@dataclasses.dataclass(frozen=True)
class SaoVariant:
  """One SAO step as specified (the defaults), or with one known bug.

  Attributes:
    advantages_from: 'updated_critic' (SAO) or 'pre_update' (advantages from the critic before its K updates).
    lam_policy: None = the length-adaptive lambda_b; a number = that fixed lambda (e.g. 1.0).
    bootstrap: 'after_last' (value of the state after the row's last token), 'before_last' (the value of
      the state in which the last token was generated) or 'none' (a cut row ends the episode: 0, as
      `algo.truncation='terminal'`).
    ratio_to: 'behavior' (the sampler's log-probs) or 'current' (the policy itself: r = 1, nothing masked).
    band: 'open' (strict `<`) or 'closed' (`<=`: edge tokens kept).
    denominator: 'all' (every action token) or 'kept' (only tokens inside the band).
    value_shift: 1 (V[t] = v[t - 1], DESIGN alignment) or 0 (V[t] = v[t]: values misaligned by one).
    chain: 'actions' (GAE's TD chain over the action tokens only, skipping observations: SAO) or 'span' (the
      chain runs through every token from a row's first action to its last: `algo.gae_over='span'`, the
      ablation; its critic also fits those tokens).
    tempered: True (the policy's log-probs at the sampler's temperature) or False (at temperature 1 whatever
      the sampler's: the ratio of the untempered policy to the tempered sampler).
  """
  advantages_from: str = 'updated_critic'
  lam_policy: float | None = None
  bootstrap: str = 'after_last'
  ratio_to: str = 'behavior'
  band: str = 'open'
  denominator: str = 'all'
  value_shift: int = 1
  chain: str = 'actions'
  tempered: bool = True


@dataclasses.dataclass(frozen=True)
class GrpoVariant:
  """One GRPO step as specified (the defaults), or with one known bug.

  Attributes:
    std_normalize: divide by the group's reward std (GRPO) or not.
    baseline: 'mean' (group mean) or 'leave_one_out' (mean of the other rows of the group).
    agg: 'token_mean' or 'seq_mean_token_mean' (mean over rows of the row's token mean).
  """
  std_normalize: bool = True
  baseline: str = 'mean'
  agg: str = 'token_mean'


# ---------------------------------------------------------------------------------------------------------
# Model calls (float32, jitted once per shape) and their gradients.


# Compiling is most of the reference's cost and its programs run once: compile them cheaply.
_jit = functools.partial(jax.jit, static_argnums=0, compiler_options={
    'xla_backend_optimization_level': 0, 'xla_llvm_disable_expensive_passes': True})


def _split(model: nnx.Module, trained) -> tuple:
  return nnx.split(model, trained, ...)


def _logprobs(graphdef, params, rest, tokens, temperature=1.0):
  """logp[b, t] = log_softmax(logits[b, t - 1] / temperature)[tokens[b, t]] for t >= 1, 0 at t = 0 (full
  logits)."""
  logits = nnx.merge(graphdef, params, rest)(tokens)
  logsm = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32) / temperature, axis=-1)
  lp = jnp.take_along_axis(logsm, tokens[:, 1:, None], axis=-1)[..., 0]
  return jnp.pad(lp, ((0, 0), (1, 0)))


token_logprobs = _jit(_logprobs)


def _critic_outputs(critic: nnx.Module, tokens: jax.Array) -> jax.Array:
  """v[b, t] = w . h[b, t] + c: the critic's value of the state after token t (float32 [B, T])."""
  h = critic.backbone.hidden(tokens).astype(jnp.float32)
  return h @ critic.head.kernel[...].astype(jnp.float32) + critic.head.bias[...].astype(jnp.float32)


def _shift(v: jax.Array, value_shift: jax.Array) -> jax.Array:
  """V[b, t] = v[b, t - 1] (value_shift = 1, V[b, 0] = 0) or v[b, t] (value_shift = 0); traced, one compile."""
  return jnp.where(value_shift == 1, jnp.pad(v[:, :-1], ((0, 0), (1, 0))), v)


@_jit
def _critic_forward(graphdef, params, rest, tokens):
  return _critic_outputs(nnx.merge(graphdef, params, rest), tokens)


@_jit
def _critic_grad(graphdef, params, rest, tokens, returns, mask, value_shift):
  """grad of the masked MSE `sum_{b,t} m 0.5 (V - R)^2 / sum m` w.r.t. the trained critic parameters."""
  def loss(p):
    values = _shift(_critic_outputs(nnx.merge(graphdef, p, rest), tokens), value_shift)
    return jnp.sum(mask * 0.5 * jnp.square(values - returns)) / jnp.sum(mask)
  return jax.grad(loss)(params)


@_jit
def _policy_grad(graphdef, params, rest, tokens, coef, temperature):
  """grad of `sum_{b,t} coef[b, t] logp[b, t]` (coef is a constant: the stop-gradient weights of the loss)."""
  return jax.grad(lambda p: jnp.sum(coef * _logprobs(graphdef, p, rest, tokens, temperature)))(params)


def _sgd(params, grads, lr):
  return jax.tree.map(lambda p, g: p - jnp.float32(lr) * g, params, grads)


def flat(params) -> dict[str, np.ndarray]:
  """`{keystr path: array}` of a parameter tree (the same keys as the learner's train-state params)."""
  return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(params)}


# ---------------------------------------------------------------------------------------------------------
# Scalar parts in float64 numpy, written as loops.


def gae(rewards, values, mask, bootstrap, gamma, lam) -> tuple[np.ndarray, np.ndarray]:
  """Skip-observation GAE (float64 loops): (advantages, returns), 0 off the action positions.

  For the action positions i_1 < ... < i_n of row b: delta_k = r[i_k] + gamma V[i_{k+1}] - V[i_k] with
  V[i_{n+1}] = bootstrap[b], A_k = delta_k + gamma lam[b] A_{k+1}; returns = A + V.
  """
  rows, length = rewards.shape
  adv = np.zeros((rows, length))
  ret = np.zeros((rows, length))
  for b in range(rows):
    next_value, running = float(bootstrap[b]), 0.0
    for t in reversed(range(length)):
      if not mask[b, t]:
        continue
      delta = float(rewards[b, t]) + gamma * next_value - float(values[b, t])
      running = delta + gamma * float(lam[b]) * running
      adv[b, t] = running
      ret[b, t] = running + float(values[b, t])
      next_value = float(values[b, t])
  return adv, ret


def adaptive_lambda(mask, alpha) -> np.ndarray:
  """lambda_b = 1 - 1 / (alpha l_b), l_b = the row's action tokens (0 for a row without any)."""
  out = np.zeros(mask.shape[0])
  for b in range(mask.shape[0]):
    n = int(mask[b].sum())
    out[b] = 1.0 - 1.0 / (alpha * n) if n else 0.0
  return out


def span(mask) -> np.ndarray:
  """1 from each row's first action token to its last (observation tokens between them included)."""
  out = np.zeros(mask.shape)
  for b in range(mask.shape[0]):
    acted = np.flatnonzero(mask[b])
    if len(acted):
      out[b, acted[0]:acted[-1] + 1] = 1.0
  return out


def _last_real_token(row_tokens_mask) -> int:
  return int(np.flatnonzero(row_tokens_mask)[-1])


# ---------------------------------------------------------------------------------------------------------
# The steps.


@dataclasses.dataclass
class StepResult:
  """Parameters after the step and the intermediate quantities (float64) for the tests' checks."""
  policy: dict[str, np.ndarray]
  critic: dict[str, np.ndarray] | None
  ratio: np.ndarray
  kept: np.ndarray
  advantages: np.ndarray
  mask: np.ndarray
  extra: dict


def _policy_update(policy: nnx.Module, tokens: np.ndarray, coef: np.ndarray, actor_lr: float,
                   trained=nnx.Param, temperature: float = 1.0) -> dict:
  """One SGD step on the surrogate `sum_{b,t} coef[b, t] logp[b, t]` (coef: the loss's constant weights) of the
  `trained` parameters."""
  graphdef, params, rest = _split(policy, trained)
  grads = _policy_grad(graphdef, params, rest, jnp.asarray(tokens), jnp.asarray(coef, jnp.float32),
                       jnp.float32(temperature))
  return flat(_sgd(params, grads, actor_lr))


def sao_step(policy: nnx.Module, critic: nnx.Module, batch, s: Settings, variant: SaoVariant = SaoVariant(),
             *, real_tokens: np.ndarray, policy_trained=nnx.Param, critic_trained=CRITIC_TRAINED) -> StepResult:
  """One SAO learner step from the formulas (module docstring); `real_tokens[B, T]` marks non-padding tokens;
  `policy_trained`, `critic_trained`: the parameters each SGD step moves (LoRA: adapters, and the critic's head)."""
  v = variant
  tokens = np.asarray(batch.tokens)
  mask = np.asarray(batch.action_mask, np.float64) * np.asarray(batch.segment_mask, np.float64)[:, :1]
  rewards = np.asarray(batch.rewards, np.float64)
  truncated = np.asarray(batch.truncated, bool)[:, 0]
  behavior = np.asarray(batch.behavior_logprobs, np.float64)
  rows = tokens.shape[0]

  cgraph, cparams, crest = _split(critic, critic_trained)

  def values_and_bootstrap(params):
    out = np.asarray(_critic_forward(cgraph, params, crest, jnp.asarray(tokens)), np.float64)
    values = np.zeros_like(out)
    values[:, v.value_shift:] = out[:, :out.shape[1] - v.value_shift]
    boot = np.zeros(rows)
    for b in range(rows):
      if truncated[b] and mask[b].any() and v.bootstrap != 'none':
        last = _last_real_token(real_tokens[b])
        boot[b] = out[b, last] if v.bootstrap == 'after_last' else values[b, last]
    return values, boot

  chain = mask if v.chain == 'actions' else span(mask)

  # Fixed returns (lambda_critic = 1) from the critic before its update.
  values_old, boot_old = values_and_bootstrap(cparams)
  _, returns = gae(rewards, values_old, chain, boot_old, s.gamma, np.ones(rows))

  # K critic SGD updates on the fixed returns.
  returns32, mask32 = jnp.asarray(returns, jnp.float32), jnp.asarray(chain, jnp.float32)
  params = cparams
  for _ in range(s.critic_epochs):
    grads = _critic_grad(cgraph, params, crest, jnp.asarray(tokens), returns32, mask32, v.value_shift)
    params = _sgd(params, grads, s.critic_lr)
  critic_after = flat(params)

  # Policy advantages from the updated critic, length-adaptive lambda.
  values_new, boot_new = (values_and_bootstrap(params) if v.advantages_from == 'updated_critic'
                          else (values_old, boot_old))
  lam = adaptive_lambda(mask, s.alpha) if v.lam_policy is None else np.full(rows, float(v.lam_policy))
  advantages, _ = gae(rewards, values_new, chain, boot_new, s.gamma, lam)
  advantages = advantages * mask  # The policy trains on its own tokens.

  # Ratio to the behaviour log-probs, strict band, one SGD step on the token mean.
  temperature = s.temperature if v.tempered else 1.0
  pgraph, pparams, prest = _split(policy, policy_trained)
  logp0 = np.asarray(token_logprobs(pgraph, pparams, prest, jnp.asarray(tokens), jnp.float32(temperature)),
                     np.float64)
  ratio = np.exp(logp0 - behavior) if v.ratio_to == 'behavior' else np.ones_like(logp0)
  lo, hi = 1.0 - s.eps_low, 1.0 + s.eps_high
  kept = (ratio > lo) & (ratio < hi) if v.band == 'open' else (ratio >= lo) & (ratio <= hi)
  n = mask.sum() if v.denominator == 'all' else (mask * kept).sum()
  coef = -np.where(kept, ratio, 0.0) * advantages * mask / n
  policy_after = _policy_update(policy, tokens, coef, s.actor_lr, policy_trained, temperature)
  return StepResult(policy=policy_after, critic=critic_after, ratio=ratio, kept=kept, advantages=advantages,
                    mask=mask, extra={'returns': returns, 'values_old': values_old, 'values_new': values_new,
                                      'bootstrap_old': boot_old, 'bootstrap_new': boot_new, 'lam': lam,
                                      'logp': logp0})


def grpo_advantages(row_rewards: np.ndarray, s: Settings, variant: GrpoVariant = GrpoVariant()) -> np.ndarray:
  """Per-row advantages of contiguous groups of `s.group_size` rows (float64 loops)."""
  g = s.group_size
  out = np.zeros(row_rewards.shape[0])
  for start in range(0, row_rewards.shape[0], g):
    r = [float(x) for x in row_rewards[start:start + g]]
    mean = sum(r) / g
    std = (sum((x - mean) ** 2 for x in r) / (g - 1)) ** 0.5
    for i, x in enumerate(r):
      if variant.baseline == 'leave_one_out':
        a = x - (sum(r) - x) / (g - 1)
      else:
        a = x - mean
      out[start + i] = a / (std + s.group_eps) if variant.std_normalize and variant.baseline == 'mean' else a
  return out


def grpo_step(policy: nnx.Module, batch, s: Settings, variant: GrpoVariant = GrpoVariant()) -> StepResult:
  """One GRPO learner step with the PPO clip from the formulas (module docstring)."""
  tokens = np.asarray(batch.tokens)
  mask = np.asarray(batch.action_mask, np.float64) * np.asarray(batch.segment_mask, np.float64)[:, :1]
  row_rewards = (np.asarray(batch.rewards, np.float64) * mask).sum(axis=1)
  adv_rows = grpo_advantages(row_rewards, s, variant)
  advantages = adv_rows[:, None] * mask

  pgraph, pparams, prest = _split(policy, nnx.Param)
  logp0 = np.asarray(token_logprobs(pgraph, pparams, prest, jnp.asarray(tokens), jnp.float32(s.temperature)),
                     np.float64)
  ratio = np.exp(logp0 - np.asarray(batch.behavior_logprobs, np.float64))
  lo, hi = 1.0 - s.eps_low, 1.0 + s.eps_high
  # d/dlogp of -min(r A, clip(r) A) is -r A unless the clipped branch is the smaller one (ratio out of the
  # band on the side of A's sign), where it is 0.
  kept = ~(((advantages > 0) & (ratio > hi)) | ((advantages < 0) & (ratio < lo)))
  per_token = -ratio * advantages * kept * mask
  if variant.agg == 'token_mean':
    coef = per_token / mask.sum()
  else:
    n_b = mask.sum(axis=1, keepdims=True)
    coef = per_token / np.maximum(n_b, 1) / (n_b > 0).sum()
  return StepResult(policy=_policy_update(policy, tokens, coef, s.actor_lr, temperature=s.temperature), critic=None, ratio=ratio, kept=kept,
                    advantages=advantages, mask=mask, extra={'row_advantages': adv_rows, 'logp': logp0})
