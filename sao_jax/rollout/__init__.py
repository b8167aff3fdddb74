"""Rollout: the ONE episode runner, its generation backends, the episode -> token layout and packing.

    backend = SamplerBackend(model, stop_ids=stop_ids_for(env, tokenizer), pad_id=tokenizer.pad_id,
                             max_total_len=config.sampler.max_seq_len, version=step)
    trajs = run_episodes(backend, tokenizer, envs, limits=EpisodeLimits.from_config(config),
                         decoding=SamplingParams.from_config(config.sampler), seeds=seeds, group_ids=group_ids)
    packed = pack(trajs, seq_buckets=config.trainer.seq_buckets, pad_id=tokenizer.pad_id,
                  rows=config.trainer.batch_size, group_size=config.algo.group_size,
                  truncation=config.algo.truncation)

- `backends`: `Backend` protocol, `Generation`, `SamplerBackend` (the static engine), `ContextBackend`,
  `make_backend` (a task's static backend), `task_stop_ids`.
- `episodes`: `EpisodeLimits`, `run_episodes` (batched, multi-turn), `run_episode` (one episode, same loop),
  `replay_episode` (given action texts through the same loop: reference episodes).
- `layout`: `Turn`, `episode_to_trajectory`, `message_observation_ids`, `stop_ids_for`, `safe_decode`.
- `pack`: `pack(...) -> Packed(batch, kept, dropped)` (one trajectory per row, or several: `packing`),
  `plan_packing`, `allowed_rows`, `select` (what a batch can take), `check_batch`, `padding_fraction`,
  `DROP_REASONS`, `PACKINGS`.
- `trajectory_queue`: the bounded `TrajectoryQueue` between actors and the learner (staleness, whole groups).
- `prompts`: `PromptSource` (the shared, numbered prompt stream), `ProcessShard` (one process's share).
- `actor`: `make_engine`, `Actor`, `ActorThread` (what the trainer runs).
"""

from sao_jax.rollout.backends import (Backend, ContextBackend, GenerateFn, Generation, SamplerBackend, make_backend,
                                     task_stop_ids)
from sao_jax.rollout.episodes import EpisodeLimits, episode_seed, replay_episode, run_episode, run_episodes
from sao_jax.rollout.layout import Turn, episode_to_trajectory, message_observation_ids, safe_decode, stop_ids_for
from sao_jax.rollout.pack import (DROP_REASONS, PACKINGS, Packed, allowed_rows, check_batch, pack, padding_fraction,
                                 plan_packing, select)
from sao_jax.rollout.trajectory_queue import BatchDraw, QueueClosed, TrajectoryQueue
