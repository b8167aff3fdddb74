"""The pod-scale workload of the design argument: assumptions, each stated, in one place.

Hardware and model (assumed, not measured here; no pod is available to this project):
  - policy and critic: 7B-parameter Llama-class models (GQA, 8 KV heads, 32 layers, head dim 128: 128 KiB of
    bf16 KV cache per token).
  - actors: 128 H100-class chips, 8 episodes (slots) each = 1024 slots. At a 64K-token context a slot's KV cache
    is ~8 GiB, so a decode step reads ~14 GiB of weights + ~64 GiB of cache per chip at ~3.3 TB/s: ~25 ms per
    step, i.e. **30 generated tokens/s per slot** (memory-bound batched decode). Observation tokens are
    prefilled at **3000 tokens/s per slot** (compute-bound, chunked into the decode batches).
  - learner: 32 chips at 40% of 989 TFLOP/s bf16. An SAO step costs ~22 P FLOPs per token (policy update 6P,
    K=2 critic updates 12P, two critic forwards 4P), so **12 us per token** of the batch, plus **5 s** fixed
    (optimizer, host, batch assembly). A batch of 128 x ~56K tokens: ~92 s.
  - weight publishing (reshard learner -> actor mesh): **10 s**.
Episodes (agentic, multi-turn tool use; 32K-128K-token contexts, heavy tail):
  - prompt 2000 tokens; turns ~ log-normal(mean 10, sigma 0.5), clipped to [1, 32];
  - generated tokens per turn ~ log-normal(mean 3000, sigma 1.0) (the tail knob of the sweeps);
  - observation tokens per tool call ~ log-normal(mean 3000, sigma 1.0); tool latency ~ log-normal(mean 15 s,
    sigma 1.0);
  - a per-prompt length factor ~ log-normal(mean 1, sigma 0.5) shared by a GRPO group's members (a prompt's
    episodes are alike; the marginal distribution of one episode is the same for every G);
  - contexts are cut at 131072 tokens (the episode is truncated there).
Pipeline: B = 128 trajectories per step, queue of 2B, turn-level weight switching on, a simulated day with the
first 2 hours left out of the figures (warm-up).
"""

from __future__ import annotations

import dataclasses

from sao_jax.sim.dists import Dist
from sao_jax.sim.simulator import SimConfig

POD = SimConfig(
    num_slots=1024, batch_size=128, group_size=1, mode='async',
    tokens_per_s=30.0, prefill_tokens_per_s=3000.0, prompt_tokens=2000.0,
    turns=Dist('lognormal', 10.0, sigma=0.5, lo=1.0, hi=32.0),
    gen_tokens=Dist('lognormal', 3000.0, sigma=1.0),
    obs_tokens=Dist('lognormal', 3000.0, sigma=1.0),
    tool_latency_s=Dist('lognormal', 15.0, sigma=1.0),
    max_episode_tokens=131072.0, prompt_sigma=0.5,
    step_time_s=Dist('constant', 5.0), step_time_per_token_s=12e-6, publish_delay_s=10.0,
    turn_level_switch=True, duration_s=86400.0, warmup_s=7200.0, seed=0)


def pod_config(**overrides) -> SimConfig:
  """POD with fields replaced (validated)."""
  return dataclasses.replace(POD, **overrides).validate()
