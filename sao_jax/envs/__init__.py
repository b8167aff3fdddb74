"""Environments, verifiers and datasets: tasks registered by name, built from `config.task`.

    task = envs.get_task(config.task)
    it = task.train_iterator(seed)             # resumable: it.state() / it.restore(state)
    env = task.make_env(next(it))
    messages = env.reset()
    obs, reward, done, info = env.step(action_text)

Text level only: no jax, no models (tokens and the episode -> token layout live in `sao_jax.rollout`).

Names are resolved lazily (PEP 562), so a verifier worker process that imports `sao_jax.envs.verifier`
does not pay for jax. Task modules (arith, calculator, code, math, drift) are imported by the registry.
"""

import importlib

_EXPORTS = {
    'BaseEnv': 'base', 'Env': 'base', 'Example': 'base', 'ExampleIterator': 'base', 'guarded_step': 'base',
    'StepResult': 'base', 'Task': 'base',
    'get_task': 'registry', 'register_task': 'registry', 'task_names': 'registry',
    'validate_task_config': 'registry',
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
  if name in _EXPORTS:
    return getattr(importlib.import_module(f'sao_jax.envs.{_EXPORTS[name]}'), name)
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
