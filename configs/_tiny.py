"""The tiny override: a tiny model, short episodes and small batches for any config, as `config.<path>` values.

The trainer tests (tests/trainer_helpers.py) and the experiments' `--quick` runs apply it, so the same shapes (and
compiled programs) serve every test and config. Not a config itself (the leading `_` keeps it out of the configs
the tests list).
"""

from typing import Any

# Every config's longest prompt with the char tokenizer is under 180 tokens (code/imo/math samples): one prompt
# bucket and one sequence bucket of 224 hold any of them plus a turn.
TINY: dict[str, Any] = {
    'model.name': 'tiny',
    'model.hf_dir': '',  # No checkpoint's weights (configs/smollm2_arith.py names one): the random tiny model.
    'model.tokenizer': 'char',
    'task.eval_size': 2,
    'sampler.batch_size': 8,
    'sampler.max_new_tokens': 8,
    'sampler.max_seq_len': 224,
    'sampler.prompt_buckets': (224,),
    'trainer.batch_size': 8,
    'trainer.seq_buckets': (224,),
    'trainer.queue_size': 16,
    'trainer.num_steps': 2,
    'trainer.eval_every': 0,
    'trainer.checkpoint_every': 0,
    'trainer.tensorboard': False,
    'sft.steps': 0,  # No warm start (configs/arith.py has one; tests/sft_test.py covers it).
}
