"""The calculator's parsing is linear in the model's text and a step's timeout holds on hostile turns; its reference
episode (the warm start's data) earns the full reward from the real env."""

import threading
import time

from absl.testing import absltest
from absl.testing import parameterized
import ml_collections

from sao_jax import envs
from sao_jax.errors import ConfigError
from sao_jax.envs import answers
from sao_jax.envs import calculator


def _env(**kwargs):
  task = envs.get_task(ml_collections.ConfigDict(
      {'name': 'calculator', 'max_turns': 3, 'eval_size': 4, 'kwargs': kwargs}))
  env = task.make_env(task.eval_set()[0])
  env.reset()
  return env


class ToolCallTest(parameterized.TestCase):

  @parameterized.parameters(
      ('<calc>1+2</calc>', '1+2'),
      ('a <calc>1</calc> b <calc>2*3</calc> c', '2*3'),
      ('<calc>x<calc>2</calc>', '2'),
      ('<calc>1+2', None),
      ('</calc><calc>', None),
      ('no tool', None),
      ('<calc></calc>', ''),
  )
  def test_last_complete_call(self, text, want):
    self.assertEqual(calculator.tool_call(text), want)

  def test_linear_on_repeated_unclosed_tags(self):
    # The old tag regex took > 40 s on 240k chars of repeated unclosed <calc> tags (quadratic, GIL held).
    for text in ('<calc>' * 400_000, '<calc>' * 400_000 + '</calc>', '</calc>' + '<calc>' * 400_000):
      t0 = time.monotonic()
      calculator.tool_call(text)
      self.assertLess(time.monotonic() - t0, 0.5)

  @parameterized.parameters('tag', 'boxed')
  def test_lenient_answer_parsing_is_linear(self, fmt):
    # `<answer>\s*([+-]?[\d,\s]+?)\s*</answer>` was quadratic on a long run of spaces (16k chars: 1.9 s).
    opener = {'tag': '<answer>', 'boxed': '\\boxed{'}[fmt]
    t0 = time.monotonic()
    for text in (opener + '1' + ' ' * 200_000 + 'x', (opener + '1 ') * 50_000):
      self.assertIsNone(answers.parse(text, fmt, strict=False))
    self.assertLess(time.monotonic() - t0, 1.0)
    self.assertEqual(answers.parse(f'{opener} +1,234 {"</answer>" if fmt == "tag" else "}"}', fmt, strict=False),
                     '1234')


class HostileTurnTest(absltest.TestCase):

  def test_step_timeout_holds_on_240k_chars_of_unclosed_tags(self):
    # guarded_step's 1 s timeout returned after 14.5 s while the other threads froze (the regex held the GIL).
    env = _env()
    ticks = []
    stop = threading.Event()

    def ticker():  # Another thread of the actor: must keep running while the step works.
      while not stop.is_set():
        ticks.append(time.monotonic())
        time.sleep(0.01)

    t = threading.Thread(target=ticker, daemon=True)
    t.start()
    t0 = time.monotonic()
    try:
      obs, reward, done, info = envs.guarded_step(env, '<calc>' * 40_000, timeout_s=1.0)
    finally:
      stop.set()
      t.join()
    self.assertLess(time.monotonic() - t0, 1.5)
    self.assertEqual((obs, reward, done), (None, 0.0, True))
    self.assertNotIn('error', info)  # The model's fault: scored 0, not an environment error.
    self.assertEqual(info['overlong'], 240_000)
    gaps = [b - a for a, b in zip(ticks, ticks[1:])]
    self.assertLess(max(gaps, default=0.0), 0.5)

  def test_long_turn_under_the_cap_is_parsed_quickly(self):
    env = _env(max_action_chars=1_000_000)
    t0 = time.monotonic()
    obs, _, done, _ = env.step('<calc>' * 150_000 + '2+3</calc>')
    self.assertLess(time.monotonic() - t0, 1.0)
    self.assertEqual((obs, done), ('<result>5</result>', False))

  def test_bad_cap_names_the_field(self):
    with self.assertRaisesRegex(ConfigError, r'config\.task\.kwargs\.max_action_chars'):
      _env(max_action_chars=0)


class ReferenceEpisodeTest(parameterized.TestCase):

  @parameterized.product(mode=('inline', 'message'), fmt=('tag', 'boxed'), instructions=(True, False))
  def test_solution_actions_played_through_the_env_earn_reward_1(self, mode, fmt, instructions):
    task = envs.get_task(ml_collections.ConfigDict(
        {'name': 'calculator', 'max_turns': 2, 'eval_size': 8,
         'kwargs': {'observation_mode': mode, 'answer_format': fmt, 'tool_instructions': instructions}}))
    for ex in task.eval_set():
      expr = ex.data['expression']
      self.assertEqual('<calc>' in ex.prompt, instructions)  # The tool explained in the prompt, or not.
      value = eval(expr, {'__builtins__': {}})  # pylint: disable=eval-used  (digits and + - * only)
      self.assertEqual(ex.answer, str(value))
      call, final = task.solution_actions(ex)
      env = task.make_env(ex)
      env.reset()
      obs, reward, done, info = env.step(call)
      self.assertEqual((obs, reward, done, info['tool_calls']), (f'<result>{value}</result>', 0.0, False, 1))
      _, reward, done, info = env.step(final)
      self.assertEqual((reward, done, info['correct'], info['tool_calls']), (1.0, True, True, 1))
      # The final turn reads the answer off the tool's result: no arithmetic of its own.
      self.assertIn(str(value), final)


if __name__ == '__main__':
  absltest.main()
