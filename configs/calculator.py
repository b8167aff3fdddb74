"""calculator: multi-turn tool use (`<calc>expr</calc>` -> `<result>v</result>`); exercises skip-obs GAE.

    python -m sao_jax.main --config=configs/calculator.py[:MAX_TURNS] --workdir=/tmp/sao_calc   (default 4 turns)

The 0.14M-parameter `demo` decoder (char tokenizer), randomly initialised, learns to use the tool on 3-4-digit
problems with 2 operators: a supervised warm start on the task's reference episodes (`config.sft`), then
SAO (agentic band). A reference episode, laid out by the rollout's episode runner exactly as a sampled one (loss
and policy gradient on the assistant's tokens only, never on the tool's result):

    <calc>560*1313+9537</calc> | <result>744817</result> | <answer>744817</answer><|end|>
    (assistant: tool call)       (observation, inline)      (assistant: the answer)

The model copies the expression into the call and the result into the answer; the tool does the arithmetic. The
prompt is the problem alone (`tool_instructions=False`): the warm start teaches the tool and the answer format,
and a tool description would make every episode four times longer. Held-out greedy accuracy (step 0 = after the
warm start): WORKDIR/metrics.jsonl.
"""

import ml_collections

from configs import base


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = base.get_config()
  c.model.name = 'demo'  # 2 layers, width 64, vocabulary 128 (the char tokenizer's 111 tokens).
  c.task.name = 'calculator'
  c.task.max_turns = int(arg) if arg else 4  # Tool calls + the final answer.
  c.task.kwargs = ml_collections.ConfigDict(dict(
      min_digits=3,  # Operands of 3-4 digits: hard by heart, easy with the tool.
      max_digits=4,  # Most digits of an operand.
      min_ops=2,  # Fewest operators.
      max_ops=2,  # Most operators.
      ops='+-*',  # Operator set.
      answer_format='tag',  # Final answer as <answer>N</answer>.
      observation_mode='inline',  # Results appended inside the assistant's stream (stop at </calc>).
      tool_instructions=False,  # The prompt is 'Compute 560*1313+9537.' (the warm start teaches the tool) ...
      instruct_format=False,  # ... and the answer format.
      format_reward=0.0,  # Exact match only.
  ))
  c.algo.domain = 'agentic'  # The presets' agentic setting (SAO: band (0.8, 3.0)).

  # ---- Lengths (char tokens): the prompt '<|user|>Compute 9999*9999*9999.<|end|><|assistant|>' is 26, the call
  # '<calc>9999*9999*9999</calc>' 16, the result '<result>999700029999</result>' 14, the answer and its end 15:
  # 71 in all for the longest reference episode.
  c.sampler.max_new_tokens = 20  # Per turn: the longest call or answer, and some slack.
  c.sampler.max_seq_len = 128  # Whole episode: room for 4 turns of tool calls (the turn limit cuts first).
  c.sampler.prompt_buckets = (32,)  # One prompt shape: one compile.
  c.trainer.seq_buckets = (80, 128)  # Packed lengths: the warm start's rows and most episodes (one call, then the
  # answer) fit 80; a batch with a longer episode (repeated calls) takes 128 (a second compile of the step).

  # ---- Supervised warm start on reference episodes, stopped early on purpose, so that SAO does a measurable share
  # of the rise: the copying clicks in between 100 and 200 steps (docs/benchmarks/demo.md), so the step-0 level
  # varies with the seed.
  c.sft.steps = 160  # Cross-entropy steps.
  c.sft.batch_size = 64  # Problems per step (a fresh problem for every row).
  c.sft.lr = 2e-3  # Peak learning rate (arith's).
  c.sft.warmup_steps = 20  # Linear warmup.
  c.sft.schedule = 'constant'  # No decay.
  c.sft.log_every = 100  # Loss lines.

  # ---- SAO.
  c.trainer.mode = 'async'  # Sampler thread + queue, the learner updates as soon as a batch is there.
  c.trainer.batch_size = 64  # Trajectories per learner step.
  c.trainer.num_steps = 300  # Learner steps.
  c.trainer.max_staleness = 4  # Drop trajectories more than 4 versions behind the learner.
  c.trainer.queue_size = 64  # One sampler call of room: trajectories lag the learner by one version.
  c.task.eval_size = 256  # Held-out problems (a fixed stream, never trained on).
  c.trainer.eval_every = 50  # Held-out greedy accuracy every 50 steps (and at the end).
  c.trainer.checkpoint_every = 100  # Learner steps between checkpoints (a killed run resumes).
  c.sampler.batch_size = 64  # Episodes per sampler call (one learner batch).
  c.sampler.num_threads = 1  # One sampler thread (2 cores: the learner has the other).
  c.sampler.continuous = False  # Static calls, as the demo (configs/arith.py): turns of <= 20 tokens and instant
  # tools leave continuous batching little to win against the compile of its slot programs.
  c.optim.actor_lr = 2e-4  # Arith's: a 0.14M-parameter model takes larger steps than SAO's 1e-6 (4e-4 first fell,
  # then rose slower: docs/benchmarks/demo.md).
  c.optim.schedule = 'cosine'  # Decay to lr * end_lr_factor over the run.
  c.optim.total_steps = 300  # Cosine horizon of both optimizers (0 = each one's own updates in the run).
  c.optim.end_lr_factor = 0.1  # Floor of the decay.
  c.optim.critic_lr = 1e-3  # Critic (value head from zero, backbone from the warm-started policy).
  return c
