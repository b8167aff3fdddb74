"""The policy `Decoder` from `config.model`: the one place eval's CLI and the trainer build a model.

    model, model_config = models.build(config.model, mesh=mesh, rules=config.mesh.rules, seed=config.seed)

`config.model.hf_dir` set: the weights (and the architecture) of that HF checkpoint (`hf_io.load_hf`, read
shard by shard onto the mesh). Otherwise `config.model.name` is a named config (`get_model_config`), randomly
initialised from `seed`; with a mesh the parameters are created directly sharded (inside one jit, with
`out_shardings` from their logical axis names), so the whole model never sits on one device.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh

from sao_jax.errors import ConfigError
from sao_jax.models import hf_io
from sao_jax.models.config import MODEL_NAMES, ModelConfig, get_model_config
from sao_jax.models.llama import Decoder


def _overrides(m: Any) -> dict[str, Any]:
  """The `ModelConfig` fields `config.model` sets over a named or HF architecture: the compute `dtype`, the
  parameters' storage `param_dtype` (an HF checkpoint's weights are cast to it), the policy's `remat` policy
  (the old bools too: `models.config.remat_policy`), the `attention_impl` and the LoRA adapters (`lora`)."""
  out = {'dtype': str(m.dtype), 'param_dtype': str(getattr(m, 'param_dtype', 'float32')),
         'remat': getattr(m, 'remat', 'none'), 'attention_impl': str(getattr(m, 'attention_impl', 'auto'))}
  lora = getattr(m, 'lora', None)
  if lora is not None and lora.rank:
    out.update(lora_rank=int(lora.rank), lora_alpha=float(lora.alpha), lora_targets=tuple(lora.targets))
  return out


def model_config_of(model_config: Any) -> ModelConfig:
  """The policy's `ModelConfig` as `build` makes it, without weights (an HF directory's `config.json` only).

  Raises:
    ConfigError: `name='hf'` without `hf_dir`, or an unknown name.
  """
  m = getattr(model_config, 'model', model_config)
  hf_dir = str(getattr(m, 'hf_dir', '') or '')
  if hf_dir:
    return ModelConfig.from_hf_config(hf_io.read_hf_config(hf_dir), **_overrides(m))
  if m.name == 'hf':
    raise ConfigError("config.model.name='hf' needs config.model.hf_dir (an HF checkpoint directory).")
  if m.name not in MODEL_NAMES:
    raise ConfigError(f'config.model.name={m.name!r}: expected one of {", ".join(MODEL_NAMES)} or "hf".')
  return get_model_config(m.name, **_overrides(m))


def build(model_config: Any, *, mesh: Mesh | None = None, rules: Sequence[Any] | None = None,
          seed: int = 0) -> tuple[Decoder, ModelConfig]:
  """Builds the policy named by `config.model`.

  Args:
    model_config: `config.model` (`name`, `hf_dir`, `dtype`, `param_dtype`, `remat`); the full config is accepted
      too.
    mesh: place the parameters on this mesh (default: the first device).
    rules: logical-axis -> mesh-axis pairs (`config.mesh.rules`); None = replicated on `mesh`.
    seed: init seed of a named (randomly initialised) model, and of fresh LoRA adapters (`config.model.lora`).

  Returns:
    `(model, model_config)`.

  Raises:
    ConfigError: `name='hf'` without `hf_dir`, or an unknown name.
  """
  m = getattr(model_config, 'model', model_config)
  hf_dir = str(getattr(m, 'hf_dir', '') or '')
  if hf_dir:
    return hf_io.load_hf(hf_dir, mesh=mesh, rules=rules, lora_seed=seed, **_overrides(m))
  cfg = model_config_of(m)

  def make() -> Decoder:
    return Decoder(cfg, rngs=nnx.Rngs(seed))

  if mesh is None:
    return make(), cfg
  from sao_jax import parallel  # pylint: disable=g-import-not-at-top  # Same-level room (as hf_io does).

  box = {}

  def init():
    with nnx.use_eager_sharding(False):
      box['graphdef'], state = nnx.split(make())
    return state

  abstract = jax.eval_shape(init)
  shardings = parallel.tree_shardings(abstract, mesh, tuple(rules or ()))
  state = jax.jit(init, out_shardings=shardings)()
  return nnx.merge(box['graphdef'], state), cfg
