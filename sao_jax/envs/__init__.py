"""Environments, verifiers and datasets: tasks registered by name, built from `config.task`.

    task = envs.get_task(config.task)
    it = task.train_iterator(seed)             # resumable: it.state() / it.restore(state)
    env = task.make_env(next(it))
    messages = env.reset()
    obs, reward, done, info = env.step(action_text)
    traj = envs.episode_to_trajectory(prompt_ids, turns, reward, truncated=...)

Task modules (arith, calculator, code, math, drift) are imported on first use by the registry.
"""

from sao_jax.envs.base import BaseEnv
from sao_jax.envs.base import Env
from sao_jax.envs.base import EpisodeLimits
from sao_jax.envs.base import episode_to_trajectory
from sao_jax.envs.base import Example
from sao_jax.envs.base import ExampleIterator
from sao_jax.envs.base import guarded_step
from sao_jax.envs.base import message_observation_ids
from sao_jax.envs.base import run_episode
from sao_jax.envs.base import StepResult
from sao_jax.envs.base import Task
from sao_jax.envs.base import Turn
from sao_jax.envs.registry import get_task
from sao_jax.envs.registry import register_task
from sao_jax.envs.registry import task_names
from sao_jax.envs.registry import validate_task_config
