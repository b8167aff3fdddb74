"""Base configuration: every knob of sao_jax, with its default and a one-line comment.

Task configs (`configs/arith.py`, `configs/imo.py`, ...) start from `get_config()` here and override.
Algorithms are presets (`--config.algo.name=ppo`); ablations are flags (`--config.algo.clip_mode=ppo`).
`sao_jax.config_lib.validate` checks a config at start and names the offending field.

Usage: `python -m sao_jax.main --config=configs/base.py[:arg]`.
"""

import ml_collections
from ml_collections.config_dict import placeholder


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """Returns the default SAO config. `arg` (after `:` on the command line) is unused here."""
  del arg
  c = ml_collections.ConfigDict()
  c.seed = 0  # Global seed: params init, sampling, data order.
  c.workdir = ''  # Output dir (checkpoints, metrics); the --workdir flag overrides it when given.

  # ---- Algorithm: which RL objective, and its loss / advantage settings.
  # `algo.name` selects a PRESET (`sao_jax.learner.algo.PRESETS`) of the settings that define the algorithm.
  # Fields marked [preset] are None here, meaning "the preset's value"; setting one to another value is an
  # ablation: allowed, logged at start and listed in `algo.ablations`.
  c.algo = a = ml_collections.ConfigDict()
  a.name = 'sao'  # One of: sao, ppo, grpo, dr_grpo, dapo, gspo, rloo.
  a.domain = 'math'  # Which published setting of the preset: math or agentic (SAO's band: (0.3, 5.0) / (0.8, 3.0)).
  a.ablations = ()  # Filled at start (do not set): each [preset] field changed, 'path: preset -> set'.
  a.clip_mode = placeholder(str)  # [preset] Policy ratio handling: double_side (SAO), ppo, dual_clip, gspo.
  a.eps_low = placeholder(float)  # [preset] Lower band: ratio <= 1 - eps_low is cut (SAO math 0.3, agentic 0.8).
  a.eps_high = placeholder(float)  # [preset] Upper band: ratio >= 1 + eps_high is cut (SAO math 5.0, agentic 3.0).
  a.dual_clip_c = 3.0  # dual_clip only: lower bound c*A on the surrogate for negative advantages (c > 1).
  a.agg = placeholder(str)  # [preset] Loss aggregation: token_mean, seq_mean_token_mean, seq_mean_token_sum.
  a.agg_max_len = 0  # seq_mean_token_sum divisor (Dr.GRPO constant); 0 = the padded sequence length T.
  a.behavior_correction = 'none'  # Decoupled PPO (needs proximal log-probs): none, tis, icepop.
  a.tis_cap = 2.0  # tis: cap C on the behaviour weight pi_prox / pi_behavior.
  a.icepop_low = 0.5  # icepop: behaviour weights below this are masked to 0.
  a.icepop_high = 2.0  # icepop: behaviour weights above this are masked to 0.
  a.gamma = 1.0  # Discount of the token-level MDP.
  a.lam_critic = placeholder(float)  # [preset] GAE lambda of the critic's value targets (SAO: 1, Monte Carlo).
  a.lam_policy = placeholder(float)  # [preset] GAE lambda of policy advantages; < 0: adaptive 1 - 1/(alpha*len).
  a.adaptive_alpha = placeholder(float)  # [preset] alpha of the length-adaptive lambda (SAO: 1.5).
  a.whiten_advantages = False  # Masked whitening of advantages over the batch's action tokens.
  a.advantages_from = placeholder(str)  # [preset] 'updated_critic' (after the K critic updates) or 'pre_update'.
  a.critic_epochs = placeholder(int)  # [preset] K: critic updates per policy update, on fixed returns.
  a.critic_warmup_steps = placeholder(int)  # [preset] Learner steps that train the critic only.
  a.value_clip_eps = 0.0  # > 0 enables PPO-style value clipping (a baseline option, not SAO).
  a.truncation = 'bootstrap'  # Cut by a length/turn limit: 'bootstrap' from V(after the row's last token), 'drop',
  # or 'terminal' (the cut ends the episode with the env's reward: tasks that score a cut reply as wrong).
  a.gae_over = placeholder(str)  # [preset] GAE's TD chain: 'actions' (SAO: skips observation tokens) or 'span'
  #                                (ablation: through the observation tokens between a row's first and last action).
  a.group_size = placeholder(int)  # [preset] Rollouts per prompt: 1 for SAO/PPO, G >= 2 for the group baselines.
  a.group_std_normalize = placeholder(bool)  # [preset] Group baselines: divide by the group's reward std (GRPO).
  a.group_baseline = placeholder(str)  # [preset] Group baselines: 'mean' (GRPO) or 'leave_one_out' (RLOO).
  a.dynamic_sampling = placeholder(bool)  # [preset] DAPO: drop groups whose rewards are all equal.
  a.kl_coef = 0.0  # Coefficient of the KL penalty to the reference policy (0 = off, no reference model).
  a.kl_estimator = 'k3'  # KL estimator for the penalty: k1, k2, k3.
  a.entropy_coef = 0.0  # Entropy bonus coefficient (0 = off).

  # ---- Optimizers (actor and critic have their own).
  c.optim = o = ml_collections.ConfigDict()
  o.optimizer = 'adamw'  # adamw, or sgd (p <- p - lr * g: no moments; for reference checks).
  o.actor_lr = 1e-6  # Peak learning rate of the policy (SAO: 1e-6).
  o.critic_lr = 5e-6  # Peak learning rate of the value model (SAO: 5e-6).
  o.schedule = 'constant'  # After warmup: constant or cosine (decay to lr * end_lr_factor).
  o.warmup_steps = 0  # Linear learning-rate warmup, in optimizer steps.
  o.total_steps = 0  # Horizon of the cosine schedule, in optimizer steps (0 = the whole run: each optimizer's
  # updates in trainer.num_steps learner steps, sao_jax.learner.optimizer_horizons; K=2 doubles the critic's).
  o.end_lr_factor = 0.1  # Cosine schedule floor as a fraction of the peak.
  o.b1 = 0.9  # AdamW beta1.
  o.b2 = 0.999  # AdamW beta2.
  o.eps = 1e-8  # AdamW epsilon.
  o.weight_decay = 0.0  # AdamW decoupled weight decay.
  o.grad_clip = 1.0  # Global-norm gradient clipping (0 = off).
  o.state_dtype = 'float32'  # Storage dtype of AdamW's moments mu and nu: float32, or bfloat16 (half their memory;
  # the update itself is computed in float32).
  o.freeze_critic_attention = placeholder(bool)  # [preset] Critic attention weights get no gradient (SAO: on).
  o.max_consecutive_skips = 5  # Stop the run after this many consecutive non-finite updates.

  # ---- Model.
  c.model = m = ml_collections.ConfigDict()
  m.name = 'tiny'  # Named config (tiny, smollm2-135m, qwen2.5-0.5b, qwen3-0.6b, llama3.2-1b) or 'hf'.
  m.hf_dir = ''  # HF checkpoint directory (config.json, safetensors, tokenizer.json) to load weights from.
  m.dtype = 'float32'  # Compute dtype: float32 or bfloat16 (parameters are cast to it at use).
  m.param_dtype = 'float32'  # Storage dtype of the policy's and the critic's parameters and gradients: float32, or
  # bfloat16 (half their memory; an update smaller than ~2^-8 of a weight is lost: sao_jax/learner/optim.py).
  m.tokenizer = 'char'  # 'char' (synthetic tasks) or 'hf' (tokenizer.json of hf_dir).
  # Rematerialisation of the policy's decoder blocks in the backward pass (activation memory against recompute):
  # none, full (keep only each block's input), dots_saveable (keep every matmul output), or
  # dots_with_no_batch_dims_saveable (keep the weight matmuls' outputs, recompute attention scores); the old
  # True / False mean full / none.
  m.remat = ml_collections.FieldReference('none', field_type=object)
  m.critic_remat = ''  # The critic's remat policy (same names; '' = the policy's config.model.remat).
  # Attention of the learner's forward passes (sao_jax/models/attention.py; same values, different memory): auto
  # (splash on TPU, flash elsewhere), reference (dense scores: T x T kept for the backward), flash (blocks with an
  # online softmax, pure JAX), splash (the Pallas TPU kernel).
  m.attention_impl = 'auto'
  # Precision of float32 matmuls in every program of the run (jax_default_matmul_precision): 'default' is the
  # backend's (one bf16 pass on TPU, TF32 on NVIDIA GPUs: the sampler's and the learner's log-probs of a token then
  # differ in the 4th decimal, as they come from different programs: docs/benchmarks/accelerators.md), 'high'
  # (bf16_3x / TF32 on GPU), 'highest' (full float32; slower matmuls on TPU and GPU). CPU computes float32 in full.
  m.matmul_precision = 'default'
  # LoRA (sao_jax/models/lora.py): rank > 0 trains low-rank adapters (y = x W + (alpha / r) x A B, B = 0 at the start)
  # over a frozen base held once and shared by the policy and the critic: only the adapters (and the critic's value
  # head) have gradients and optimizer states; checkpoints hold those only; an HF export merges them.
  m.lora = ml_collections.ConfigDict()
  m.lora.rank = 0  # The policy's adapter rank r (0 = full fine-tuning, no adapters).
  m.lora.alpha = 32.0  # An adapter adds (alpha / r) x A B.
  m.lora.targets = ('q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj')  # Adapted projections.
  m.lora.critic_rank = 0  # The critic's adapter rank (0 = the policy's).
  m.lora.critic_targets = ('gate_proj', 'up_proj', 'down_proj')  # The critic's (attention: none while it is frozen).

  # ---- Sampler (actor side generation).
  c.sampler = s = ml_collections.ConfigDict()
  s.temperature = 1.0  # Sampling temperature; the learner's policy is the same tempered one (logits / T).
  s.top_p = 1.0  # Nucleus sampling threshold (1.0 = off).
  s.top_k = 0  # Top-k cut (0 = off).
  s.max_new_tokens = 64  # Budget of generated tokens per turn.
  s.max_seq_len = 256  # Budget of the whole episode (prompt + actions + observations), in tokens.
  s.prompt_buckets = (32, 64, 128, 256)  # Prompt lengths are padded up to one of these (bounded compiles).
  s.batch_size = 16  # Prompts generated together in one sampler call.
  s.num_threads = 1  # Host sampler threads (async mode).
  s.continuous = True  # Actors play through the slot engine (continuous batching: batch_size decode slots
  # refilled as episodes end, new episodes started from the prompts' shared-prefix cache and inside decode calls);
  # False: static calls of batch_size episodes, turn by turn (fewer programs to compile; the demo's choice).
  s.decode_steps = 16  # Continuous: decode steps per device call (newcomers are admitted between calls).
  s.refill_rows = 0  # Continuous: while episodes wait, a decode call ends once this many slots are free (1: a slot
  # is refilled at once; more: fewer, larger admissions; 0: a quarter of the slots, at least 1).
  s.queue_chunk = 0  # Continuous: the longest prompt (tokens past the shared prefix) a slot takes inside a decode
  # call (longer ones are admitted between calls); 0: the smallest admission chunk (16). Set it to the task's
  # prompt length, or slots take no new episode inside a call.
  s.compile_ahead = False  # Continuous: compile every slot program before the first episode (else each at first use).

  # ---- Task / environment.
  c.task = t = ml_collections.ConfigDict()
  t.name = 'arith'  # Registered task: arith, calculator, code, math, drift.
  t.max_turns = 1  # Turn limit of a multi-turn episode.
  t.eval_size = 64  # Held-out examples in the eval set.
  t.step_timeout_s = 0.0  # Wall-clock bound of one env step (0 = none): past it the episode ends as failed (counted).
  t.kwargs = ml_collections.ConfigDict()  # Task-specific options (difficulty, data files, field names).

  # ---- Supervised warm start (sao_jax/sft.py): cross-entropy on task-generated solutions, before RL.
  # Runs on a fresh run only (not once an RL checkpoint exists), after the learner is built, before the actors start.
  c.sft = sf = ml_collections.ConfigDict()
  sf.steps = 0  # Optimizer steps of the warm start (0 = off).
  sf.batch_size = 64  # Problems (rows) per step.
  sf.lr = 1e-3  # Peak learning rate (the optimizer is config.optim's, with its own state).
  sf.warmup_steps = 0  # Linear learning-rate warmup, in warm-start steps.
  sf.schedule = 'constant'  # After warmup: constant, or cosine decay to lr * end_lr_factor at the last step.
  sf.end_lr_factor = 0.1  # Cosine floor as a fraction of sft.lr.
  sf.num_examples = 0  # Distinct training problems, cycled (0 = a fresh problem for every row).
  sf.data_seed = 1  # The problems come from the task's training stream with seed config.seed + this.
  sf.log_every = 50  # Warm-start steps between loss logs (0 = first and last only).
  sf.checkpoint_every = 100  # Warm-start steps between saves of its state in WORKDIR/warm_start (0 = only on a
  # signal and at its end): a killed warm start resumes from there.

  # ---- Device mesh and sharding.
  c.mesh = ms = ml_collections.ConfigDict()
  ms.data = 1  # Size of the data-parallel axis (-1 = all remaining devices).
  ms.fsdp = -1  # Size of the fully-sharded data-parallel axis (-1 = all remaining devices).
  ms.tensor = 1  # Size of the tensor-parallel axis.
  ms.actor_devices = 0  # Devices of each process given to the actors (their own mesh); 0 = share the learner's.
  ms.rules = (  # Logical axis name -> mesh axis (or None = replicated).
      ('batch', ('data', 'fsdp')),
      ('embed', 'fsdp'),
      ('vocab', 'tensor'),
      ('heads', 'tensor'),
      ('kv_heads', 'tensor'),
      ('mlp', 'tensor'),
      ('expert', None),  # MoE experts: None = every expert on every chip (set 'expert' on a mesh with that axis).
      ('head_dim', None),
      ('layers', None),
      ('norm', None),
  )

  # ---- Multi-host.
  c.distributed = d = ml_collections.ConfigDict()
  d.coordinator_address = ''  # host:port of process 0; '' = single process (or auto-detected on TPU).
  d.num_processes = 1  # Total number of processes.
  d.process_id = 0  # This process's index.

  # ---- Trainer (actor-learner loop).
  c.trainer = tr = ml_collections.ConfigDict()
  tr.mode = 'async'  # 'sync' (generate then train, on-policy) or 'async' (sampler threads + queue).
  tr.batch_size = 16  # Trajectories per learner step.
  tr.minibatch_size = 0  # Trajectories per optimizer step inside a learner step (0 = whole batch).
  tr.microbatch_size = 0  # Rows per gradient-accumulation chunk of one optimizer step (0 = the whole minibatch).
  tr.policy_epochs = 1  # Passes of policy updates over a batch.
  tr.num_steps = 100  # Learner steps to run.
  tr.max_train_minutes = 0.0  # Also stop once the run has trained this long (wall time less its evals, summed over a
  # resumed run's processes); that last step is evaluated and checkpointed (0 = off: num_steps alone).
  tr.max_staleness = 4  # Drop trajectories whose params version lags the learner by more than this.
  tr.queue_size = 64  # Bound of the trajectory queue (sampler blocks when full).
  tr.prefetch = True  # Async: draw, pack and place the next batch while the learner's update runs.
  tr.seq_buckets = (128, 256, 512, 1024)  # Batch row lengths: a row is padded up to one of these.
  # Sequence packing (sao_jax/rollout/pack.py): 'none' = one trajectory per row, rows padded to the smallest bucket
  # that holds the batch's longest; 'ffd' = several trajectories per row (attention and GAE within each), placed
  # first-fit decreasing into the bucket length of least padded area; 'fixed' = the same into rows of pack_len.
  # Packed, a step's row count varies (a multiple of data shards x minibatches x microbatches from a sparse set:
  # rollout.allowed_rows): minibatch_size and microbatch_size then set how many parts a batch splits into, not
  # the trajectories of each.
  tr.pack = 'none'
  tr.pack_segments = 8  # Packed: trajectories one row holds at most (S of the per-trajectory [B, S] fields).
  tr.pack_len = 0  # pack='fixed': the row length (0 = the largest of seq_buckets; >= sampler.max_seq_len).
  tr.log_every = 1  # Learner steps between metric logs.
  tr.eval_every = 0  # Learner steps between evals (0 = off).
  tr.eval_batch_size = 0  # Eval episodes per sampler call (0 = sampler.batch_size); larger calls decode faster.
  tr.checkpoint_every = 50  # Learner steps between checkpoints (0 = off).
  tr.keep_checkpoints = 3  # Checkpoints kept on disk.
  tr.save_retries = 2  # A failed checkpoint save (a full disk, a store error) is tried again this many times, then
  # the run stops with a one-line error, exit code 1 (0 = stop at the first failure).
  tr.save_retry_s = 10.0  # Seconds before the first retry; doubled before each next one.
  tr.weight_switch = 'turn'  # Actors take new weights between turns ('turn') or only between episodes ('episode').
  tr.allow_config_change = False  # Resume a workdir's checkpoint even when the config differs (named in the log).
  tr.export_hf = ''  # Write the final policy as an HF directory here ('' = off); LoRA: merged, and adapter/ (PEFT).
  tr.tensorboard = True  # TensorBoard event files in WORKDIR/tensorboard.
  tr.wandb_project = ''  # Also log to this wandb project ('' = off; needs the wandb package).
  return c
