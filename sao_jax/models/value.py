"""Value model (critic): the policy's decoder backbone with a zero-initialised scalar head.

  values[b, t] = w . hidden[b, t-1] + c   for t >= 1,      values[b, 0] = 0,

i.e. `values[b, t]` is the value of the state in which token t was generated (DESIGN token alignment);
the first token (always prompt) has no preceding state and gets 0. `w` and `c` start at zero, so a fresh
critic predicts 0 everywhere. The backbone has no lm head (the embedding table stays: it embeds tokens).

Frozen attention (SAO): `CRITIC_ATTENTION` selects every attention parameter of the critic (q/k/v/o
projections, their biases, q/k norms; all live under a path element `attn`), e.g.
`nnx.All(nnx.Param, nnx.Not(CRITIC_ATTENTION))` is what the critic optimizer trains.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
from flax import nnx

from sao_jax.models import lora
from sao_jax.models.config import ModelConfig
from sao_jax.models.llama import Decoder

Array = jax.Array

CRITIC_ATTENTION = nnx.PathContains('attn')  # Filter: the critic's attention weights (frozen in SAO).
CRITIC_TRAINABLE = nnx.All(nnx.Param, nnx.Not(CRITIC_ATTENTION))  # What an SAO critic optimizer updates.


class ValueHead(nnx.Module):
  """Scalar projection v = w . h + c with w [D] ('embed') and c [] zero-initialised."""

  def __init__(self, cfg: ModelConfig):
    pd = jnp.dtype(cfg.param_dtype)
    self.kernel = nnx.Param(jnp.zeros((cfg.embed_dim,), pd), out_sharding=('embed',), eager_sharding=False)
    self.bias = nnx.Param(jnp.zeros((), pd), out_sharding=(), eager_sharding=False)

  def __call__(self, hidden: Array) -> Array:
    return (jnp.einsum('btd,d->bt', hidden.astype(jnp.float32), self.kernel[...].astype(jnp.float32))
            + self.bias[...].astype(jnp.float32))


class ValueModel(nnx.Module):
  """Critic: `backbone` (a `Decoder` without lm head) + `head` (`ValueHead`)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.backbone = Decoder(cfg, rngs=rngs, lm_head=False)
    self.head = ValueHead(cfg)

  def __call__(self, tokens: Array, *, positions: Array | None = None, attention_mask: Array | None = None,
               segment_ids: Array | None = None) -> Array:
    """Aligned values float32 [B, T]: values[:, t] = head(hidden[:, t-1]), values[:, 0] = 0."""
    chex.assert_rank(tokens, 2)
    hidden = self.backbone.hidden(tokens, positions=positions, attention_mask=attention_mask,
                                  segment_ids=segment_ids)
    v = self.head(hidden)
    return jnp.pad(v[:, :-1], ((0, 0), (1, 0)))

  @classmethod
  def from_policy(cls, policy: Decoder, *, rngs: nnx.Rngs | None = None, remat: str = '', lora_rank: int = 0,
                  lora_targets: tuple[str, ...] = ()) -> ValueModel:
    """A critic whose backbone is a copy of `policy`'s weights (no lm head) and whose head is zero.

    The arrays are copied (same shardings and dtypes: the head is stored in `cfg.param_dtype` too), so donating
    the policy's buffers never invalidates the critic. `remat`: the critic's own remat policy
    (`models.config.REMAT_POLICIES`; '' = the policy's, `config.model.critic_remat`). `lora_rank` > 0: the critic's
    own fresh LoRA adapters (`lora.attach`, their A drawn from `rngs`) on `lora_targets`, over the policy's base
    weights (the policy's own adapters, if any, are not copied: a critic of a LoRA policy starts from its base).
    """
    cfg = policy.cfg.replace(lora_rank=lora_rank, lora_targets=tuple(lora_targets) if lora_rank else ())
    cfg = cfg.replace(remat=remat) if remat else cfg
    abstract = nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    src = nnx.state(policy, nnx.Not(lora.ADAPTERS))
    src_flat = dict(nnx.to_flat_state(src))

    def fill(path, var):
      keys = tuple(getattr(k, 'key', k) for k in path)
      if keys[0] == 'backbone' and not isinstance(var, lora.LoraParam):
        value = src_flat[keys[1:]].get_value()
        return var.replace(jnp.copy(value))
      sds = var.get_value()
      return var.replace(jnp.zeros(sds.shape, sds.dtype))

    state = jax.tree_util.tree_map_with_path(fill, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    critic = nnx.merge(graphdef, state)
    if cfg.lora_rank:  # Fresh adapters in place of the zeros above.
      lora.attach(critic.backbone.layers, cfg, (rngs or nnx.Rngs(0)).params())
    return critic
