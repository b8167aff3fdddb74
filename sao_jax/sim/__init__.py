"""Discrete-event simulator of the asynchronous actor-learner pipeline at pod scale (pure Python + NumPy, no jax).

`simulator.simulate(SimConfig(...)) -> SimResult`; CLIs: `python -m sao_jax.sim.run` (one run),
`python -m sao_jax.sim.sweep` (pod-scale tables and plots), `python -m sao_jax.sim.calibrate` (predicted vs
measured). See sao_jax/sim/README.md.
"""
