"""Tests of sao_jax.losses."""
