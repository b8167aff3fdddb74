"""drift: phases change on schedule, the rule changes with them, the phase is exposed, resume works."""

from absl.testing import absltest
from absl.testing import parameterized

from sao_jax import envs
from sao_jax.errors import ConfigError
from sao_jax.envs import answers


def _drift(eval_size=8, **kwargs):
  return envs.get_task({'name': 'drift', 'max_turns': 1, 'eval_size': eval_size, 'kwargs': kwargs})


class DriftTest(parameterized.TestCase):

  def test_phases_change_every_period_examples_and_cycle(self):
    task = _drift(period=5, phases=('ops=+', 'ops=*', 'ops=+,answer_format=boxed'))
    it = task.train_iterator(0)
    phases, metrics = [], []
    for _ in range(17):
      ex = next(it)
      phases.append(ex.data['phase'])
      metrics.append(task.metrics()['drift/phase'])
      op = '*' if ex.data['phase'] == 1 else '+'
      self.assertIn(op, ex.data['expression'])
      self.assertEqual(ex.data['answer_format'], 'boxed' if ex.data['phase'] == 2 else 'tag')
    self.assertEqual(phases, [0] * 5 + [1] * 5 + [2] * 5 + [0] * 2)
    self.assertEqual(metrics, [float(p) for p in phases])

  def test_no_cycle_stays_on_the_last_phase(self):
    task = _drift(period=2, phases=('ops=+', 'ops=*'), cycle=False)
    it = task.train_iterator(0)
    self.assertEqual([next(it).data['phase'] for _ in range(7)], [0, 0, 1, 1, 1, 1, 1])

  def test_step_schedule(self):
    task = _drift(period=10, unit='steps', phases=('ops=+', 'ops=*'))
    it = task.train_iterator(0)
    self.assertEqual(next(it).data['phase'], 0)
    task.set_step(9)
    self.assertEqual(next(it).data['phase'], 0)
    task.set_step(10)
    self.assertEqual(next(it).data['phase'], 1)
    self.assertEqual(task.metrics()['drift/phase'], 1.0)
    self.assertEqual(task.eval_set()[0].data['phase'], 1)

  def test_reward_follows_the_phase_rule_and_info_has_the_phase(self):
    task = _drift(period=1, phases=('answer_format=tag', 'answer_format=boxed'))
    it = task.train_iterator(0)
    for _ in range(2):
      ex = next(it)
      env = task.make_env(ex)
      env.reset()
      fmt = ex.data['answer_format']
      other = 'boxed' if fmt == 'tag' else 'tag'
      _, reward, _, info = env.step(answers.render(ex.answer, fmt))
      self.assertEqual((reward, info['phase']), (1.0, ex.data['phase']))
      env.reset()
      self.assertEqual(env.step(answers.render(ex.answer, other)).reward, 0.0)

  def test_solution_follows_the_rule_of_the_example_phase(self):
    # The warm start's reference replies: each example's own phase rule, whatever phase the task is in now.
    task = _drift(period=1, scratchpad='reversed', answer_format='hash',
                  phases=('ops=+', 'ops=+,answer_format=boxed'))
    it = task.train_iterator(0)
    ex0, ex1 = next(it), next(it)
    self.assertEqual((ex0.data['phase'], ex1.data['phase'], task.current_phase), (0, 1, 1))
    for ex, final in ((ex0, f'#### {ex0.answer}'), (ex1, f'\\boxed{{{ex1.answer}}}')):
      self.assertEqual(task.solution(ex), f'{ex.answer[::-1]}\n{final}')  # Sums of 1-2 digits: non-negative.
      env = task.make_env(ex)
      env.reset()
      self.assertEqual(env.step(task.solution(ex)).reward, 1.0)

  def test_hidden_format_phase(self):
    task = _drift(period=1, phases=('answer_format=tag', 'answer_format=hash,instruct_format=False'))
    it = task.train_iterator(0)
    self.assertIn('<answer>N</answer>', next(it).prompt)
    self.assertNotIn('####', next(it).prompt)

  def test_resume_gives_the_same_next_examples_and_phase(self):
    task = _drift(period=3)
    it = task.train_iterator(4)
    for _ in range(7):
      next(it)
    state = it.state()
    want = [(next(it).uid) for _ in range(6)]
    task2 = _drift(period=3)
    it2 = task2.train_iterator(0)
    it2.restore(state)
    self.assertEqual(task2.current_phase, 2)  # The phase of example 7 (index 6).
    self.assertEqual([next(it2).uid for _ in range(6)], want)

  def test_per_phase_eval_sets_are_disjoint_from_train(self):
    task = _drift(eval_size=30, period=50, min_digits=1, max_digits=1, phases=('ops=+', 'ops=-'))
    held = {e.uid for k in range(2) for e in task.eval_set_for(k)}
    self.assertLen(held, 60)
    it = task.train_iterator(0)
    drawn = {next(it).uid for _ in range(200)}
    self.assertEmpty(held & drawn)

  @parameterized.parameters(
      ({'phases': ('ops=/',)}, r'phases\[0\]\.ops'), ({'phases': ('digits=3',)}, r'phases\[0\]'),
      ({'phases': ('max_digits=x',)}, r'phases\[0\]'), ({'phases': ()}, 'phases is empty'),
      ({'period': 0}, 'period'), ({'unit': 'hours'}, 'unit'))
  def test_bad_options_name_the_field(self, kwargs, field):
    with self.assertRaisesRegex(ConfigError, f'config.task.kwargs.{field}'):
      _drift(**kwargs)


if __name__ == '__main__':
  absltest.main()
