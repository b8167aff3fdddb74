"""Mesh construction, logical-axis rules -> NamedSharding, multi-host start-up and batch feeding."""

from sao_jax.parallel.distributed import global_batch
from sao_jax.parallel.distributed import handshake_program
from sao_jax.parallel.distributed import initialize
from sao_jax.parallel.distributed import is_main_process
from sao_jax.parallel.distributed import local_row_range
from sao_jax.parallel.distributed import process_max
from sao_jax.parallel.distributed import sync
from sao_jax.parallel.distributed import to_host
from sao_jax.parallel.mesh import BATCH_AXES
from sao_jax.parallel.mesh import batch_divisor
from sao_jax.parallel.mesh import check_layout
from sao_jax.parallel.mesh import check_layout_sizes
from sao_jax.parallel.mesh import actor_device_count
from sao_jax.parallel.mesh import make_actor_mesh
from sao_jax.parallel.mesh import make_mesh
from sao_jax.parallel.mesh import MESH_AXES
from sao_jax.parallel.mesh import mesh_shape
from sao_jax.parallel.mesh import split_devices
from sao_jax.parallel.sharding import batch_sharding
from sao_jax.parallel.sharding import batch_shardings
from sao_jax.parallel.sharding import batch_spec
from sao_jax.parallel.sharding import logical_to_spec
from sao_jax.parallel.sharding import replicated
from sao_jax.parallel.sharding import rules_dict
from sao_jax.parallel.sharding import tree_shardings
