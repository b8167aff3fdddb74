"""Train states, optimizers (frozen-attention split) and the sharded SAO / GRPO-family update steps."""

from sao_jax.learner.algo import StepConfig
from sao_jax.learner.learner import Learner
from sao_jax.learner.learner import LearnerConfig
from sao_jax.learner.learner import NonFiniteUpdateError
from sao_jax.learner.optim import make_optimizer
from sao_jax.learner.optim import make_schedule
from sao_jax.learner.optim import optimizer_horizons
from sao_jax.learner.optim import OptimConfig
from sao_jax.learner.state import create_train_state
from sao_jax.learner.state import TrainState
from sao_jax.learner.state import LearnerState
