"""Pure loss and advantage functions of sao_jax: arrays in, arrays or (loss, metrics) out.

Nothing here imports the rest of the package, holds state or touches a model.
"""

from sao_jax.losses.advantages import action_span_mask
from sao_jax.losses.advantages import adaptive_lambda
from sao_jax.losses.advantages import broadcast_to_tokens
from sao_jax.losses.advantages import default_gae_impl
from sao_jax.losses.advantages import group_advantages
from sao_jax.losses.advantages import group_advantages_by_id
from sao_jax.losses.advantages import leave_one_out_advantages
from sao_jax.losses.advantages import skip_observation_gae
from sao_jax.losses.advantages import skip_observation_gae_scan
from sao_jax.losses.advantages import whiten
from sao_jax.losses.common import LOG_RATIO_CLAMP
from sao_jax.losses.common import aggregate
from sao_jax.losses.common import aggregate_count
from sao_jax.losses.common import clamp_log_ratio
from sao_jax.losses.common import masked_mean
from sao_jax.losses.common import segment_edges
from sao_jax.losses.common import sequence_sum
from sao_jax.losses.common import sequence_to_tokens
from sao_jax.losses.kl import entropy_from_logits
from sao_jax.losses.kl import kl_estimate
from sao_jax.losses.kl import masked_kl
from sao_jax.losses.policy import policy_loss
from sao_jax.losses.value import explained_variance
from sao_jax.losses.value import value_loss
