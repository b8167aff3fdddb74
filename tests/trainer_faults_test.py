"""The async loop under faults, in one run on a tiny model: a raising environment, a verifier that hangs past its
timeout, and a slow actor whose trajectories come back too stale. Training goes on; failures are logged with
their prompt and counted in metrics.jsonl; the learner never trains on a trajectory staler than max_staleness.
The actors are the default's (continuous batching)."""

import dataclasses
import re
import string
import tempfile
import threading
import time

from absl.testing import absltest

from sao_jax import metrics
from sao_jax import trainer
from sao_jax.envs import base
from sao_jax.envs import registry
from sao_jax.envs import verifier as verifier_lib
from sao_jax.tokenizers import CharTokenizer
from configs import base as base_config
from sao_jax import config_lib
from tests import trainer_helpers

BATCH = 8  # Rows of a learner step = episodes of one actor call.
MAX_STALENESS = 1


def kind_of(index: int) -> str:
  """What prompt `index` does: every 8th from 1 raises in env.step, from 2 its verifier hangs; prompts 3..7 (the
  first actor call) are slow: their env steps wait until the learner is 2 versions past them."""
  if index % BATCH == 1:
    return 'raise'
  if index % BATCH == 2:
    return 'hang'
  if 3 <= index < BATCH:
    return 'slow'
  return 'ok'


@dataclasses.dataclass
class _Shared:
  workdir: str = ''
  slow_released_at_step: int = -1
  stop: threading.Event = dataclasses.field(default_factory=threading.Event)


SHARED = _Shared()
# Every single-token printable character stops a turn: the untrained model ends most turns within its budget,
# so the env (and its failures) is reached.
_TOK = CharTokenizer()
STOP_TEXTS = tuple(c for c in string.ascii_letters + string.digits + string.punctuation
                   if len(_TOK.encode(c)) == 1)


class _Prompts(base.ExampleIterator):

  def __init__(self):
    self.index = 0

  def __next__(self):
    i = self.index
    self.index += 1
    return base.Example(uid=f'p{i}', prompt=f'Say something ({i}).', answer='', data={'kind': kind_of(i)})

  def state(self):
    return {'index': self.index}

  def restore(self, state):
    self.index = int(state['index'])


class FaultyEnv(base.BaseEnv):
  observation_mode = 'inline'
  stop_texts = STOP_TEXTS

  def __init__(self, example, pool):
    super().__init__(example, max_turns=1)
    self.pool = pool

  def _step(self, action_text):
    kind = self.example.data['kind']
    if kind == 'raise':
      raise RuntimeError('injected env failure')
    if kind == 'hang':
      try:
        self.pool.call(60.0)  # The verifier's worker sleeps 60 s; the pool kills it at its timeout.
      except verifier_lib.WorkerTimeout as e:
        return base.StepResult(None, 0.0, True, {'error': f'verifier timeout: {e}'})
    if kind == 'slow':
      deadline = time.monotonic() + 300
      while time.monotonic() < deadline and not SHARED.stop.is_set():
        steps = [r['step'] for r in metrics.read_metrics(SHARED.workdir)]
        if steps and max(steps) >= MAX_STALENESS + 1:
          SHARED.slow_released_at_step = max(steps)
          break
        time.sleep(0.05)
    return base.StepResult(None, float(len(action_text) % 2), True, {})


@dataclasses.dataclass(frozen=True)
class FaultyOptions:
  verifier_timeout_s: float = 0.5


class FaultyTask(base.Task):
  name = 'faulty_test'

  def __init__(self, opts, *, max_turns, eval_size):
    super().__init__(max_turns=max_turns, eval_size=eval_size)
    self.pool = verifier_lib.WorkerPool(time.sleep, num_workers=1, timeout_s=opts.verifier_timeout_s)

  def train_iterator(self, seed):
    del seed
    return _Prompts()

  def eval_set(self):
    return [base.Example(uid='eval0', prompt='Say something.', answer='', data={'kind': 'ok'})]

  def make_env(self, example):
    return FaultyEnv(example, self.pool)

  def close(self):
    self.pool.close()


registry.register_task('faulty_test', FaultyOptions)(FaultyTask)


class FaultsTest(absltest.TestCase):

  def tearDown(self):
    SHARED.stop.set()
    super().tearDown()

  def test_failures_are_counted_and_stale_work_is_dropped(self):
    SHARED.workdir = workdir = tempfile.mkdtemp()
    config = base_config.get_config()
    config_lib.override(config, {
        **trainer_helpers.TINY, 'workdir': workdir, 'task.name': 'faulty_test', 'task.eval_size': 0,
        'trainer.mode': 'async', 'sampler.num_threads': 2, 'sampler.max_new_tokens': 16,
        'trainer.num_steps': 4, 'trainer.max_staleness': MAX_STALENESS, 'trainer.weight_switch': 'episode'})
    with self.assertLogs('absl', level='WARNING') as logs:
      summary = trainer.run(config)
    self.assertEqual(summary['steps'], 4)
    rows = metrics.read_metrics(workdir)
    self.assertEqual([r['step'] for r in rows], [1, 2, 3, 4])
    # The slow prompts (3..7) came back, or were ended in flight, only once the learner was 2 versions on: dropped
    # and counted. A static call (prompts 0..7) is held whole by its slow rows; continuous slots only hold those.
    self.assertGreaterEqual(SHARED.slow_released_at_step, MAX_STALENESS + 1)
    slow = sum(kind_of(i) == 'slow' for i in range(BATCH))
    self.assertGreaterEqual(rows[-1]['dropped/stale'], slow if config.sampler.continuous else BATCH)
    self.assertBetween(rows[-1]['dropped/stale_in_flight'], 0, rows[-1]['dropped/stale'])
    for r in rows:
      self.assertLessEqual(r['staleness/max'], MAX_STALENESS)
    # Raising envs and hung verifiers: counted (cumulative), logged with their prompt, training went on.
    self.assertGreater(rows[-1]['failed/env_error'], 0)
    self.assertGreater(rows[-1]['failed/env_timeout'], 0)
    self.assertEqual(rows[-1]['dropped/pack'], rows[-1]['failed/env_error'] + rows[-1]['failed/env_timeout'])
    logged = re.findall(r'prompt (\d+) \(uid p(\d+)\) failed, dropped: (\w+)', '\n'.join(logs.output))
    self.assertLen(logged, rows[-1]['dropped/pack'])
    for number, uid, error in logged:
      self.assertEqual(number, uid)
      self.assertEqual(kind_of(int(uid)), {'RuntimeError': 'raise', 'verifier': 'hang'}[error])


if __name__ == '__main__':
  absltest.main()
