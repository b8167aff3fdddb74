"""sao_jax: Single-rollout Asynchronous Optimization (SAO) for RL of language models, in JAX."""

__version__ = '0.1.0'
