"""Checkpoints: the orbax manager with verified restores (`manager`) and what a learner checkpoint holds (`contents`).

- `manager`: `Checkpointer` (save, restore the newest intact step, keep-N, async), `CheckpointConfig`,
  `CheckpointState`, `abstract_target`, `fingerprints`, `load_policy` (eval, export), `check_config`.
- `contents`: `save_checkpoint` / `restore_checkpoint` of a learner and its prompt stream, and the run's config
  in it (`flat_config`, `config_differences`, `RESUMABLE_CHANGES`).
"""

from sao_jax.checkpoint.contents import RESUMABLE_CHANGES
from sao_jax.checkpoint.contents import check_resume_config
from sao_jax.checkpoint.contents import config_differences
from sao_jax.checkpoint.contents import flat_config
from sao_jax.checkpoint.contents import restore_checkpoint
from sao_jax.checkpoint.contents import save_checkpoint
from sao_jax.checkpoint.manager import ARRAY_ITEMS
from sao_jax.checkpoint.manager import JSON_ITEMS
from sao_jax.checkpoint.manager import MANIFEST
from sao_jax.checkpoint.manager import CheckpointConfig
from sao_jax.checkpoint.manager import CheckpointCorrupt
from sao_jax.checkpoint.manager import Checkpointer
from sao_jax.checkpoint.manager import CheckpointState
from sao_jax.checkpoint.manager import DAMAGED_DIR
from sao_jax.checkpoint.manager import abstract_target
from sao_jax.checkpoint.manager import check_config
from sao_jax.checkpoint.manager import fingerprints
from sao_jax.checkpoint.manager import load_policy
from sao_jax.checkpoint.manager import model_config_from_json
from sao_jax.checkpoint.manager import model_config_to_json
from sao_jax.checkpoint.manager import policy_metadata
