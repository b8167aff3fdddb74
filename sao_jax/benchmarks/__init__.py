"""Benchmark scripts: `python -m sao_jax.benchmarks.<name>` prints figures (and peers' in the same run)."""
