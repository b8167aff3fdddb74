"""Benchmark scripts: `python -m sao_jax.benchmarks.<name>` prints figures (and peers' in the same run).

A script defines its command-line flags at import, and scripts share flag names (--model, --batch): absl refuses a
flag defined twice in one process, so tests import at most one flag-defining script each and reach the rest through
flagless modules (e.g. `attention_programs`).
"""
