"""Command-line tools: `python -m sao_jax.tools.<name>` (weight conversion, reference checks)."""
