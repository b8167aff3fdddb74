"""The command line: `--dry_run` prints the resolved, validated config; bad configs and overrides fail naming the
field (the checks themselves: tests/config_lib_test.py)."""

import os
import re
import subprocess
import sys
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
from tests import multiprocess


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _main(*args: str, devices: int = 1) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS='cpu', XLA_FLAGS=multiprocess.child_xla_flags(devices))
  return subprocess.run([sys.executable, '-m', 'sao_jax.main', *args], cwd=_ROOT, env=env,
                        capture_output=True, text=True, timeout=120, check=False)


class MainTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.workdir = f'--workdir={tempfile.mkdtemp()}'

  def test_dry_run_prints_resolved_config(self):
    out = _main('--config=configs/base.py', '--config.algo.name=ppo', self.workdir, '--dry_run')
    self.assertEqual(out.returncode, 0, out.stderr)
    for line in ('name: ppo', 'clip_mode: ppo', 'critic_epochs: 1', 'lam_policy: 0.95', 'critic_warmup_steps: 0',
                 'freeze_critic_attention: false', 'ablations: !!python/tuple []'):
      self.assertIn(line, out.stdout)
    self.assertNotIn('null', out.stdout.split('distributed:')[0])  # Every preset field of algo resolved.

  def test_ablation_flag_is_typed_logged_and_printed(self):
    out = _main('--config=configs/base.py', '--config.algo.clip_mode=ppo', '--config.algo.eps_low=0.25',
                self.workdir, '--dry_run')
    self.assertEqual(out.returncode, 0, out.stderr)
    self.assertIn('eps_low: 0.25', out.stdout)
    self.assertIn("- 'algo.eps_low: 0.3 -> 0.25'", out.stdout)  # Recorded in the config.
    self.assertIn('ABLATION', out.stderr)
    self.assertIn('algo.eps_low: 0.3 -> 0.25', out.stderr)
    self.assertIn('critic_epochs: 2', out.stdout)  # Still SAO's other settings.

  def test_misspelled_override_names_the_field(self):
    out = _main('--config=configs/base.py', '--config.algo.clip_mod=ppo', self.workdir, '--dry_run')
    self.assertNotEqual(out.returncode, 0)
    self.assertIn('--config.algo.clip_mod', out.stderr)
    self.assertIn('clip_mode', out.stderr)

  @parameterized.parameters(
      (('--config.algo.eps_low=1.5',), 'config.algo.eps_low=1.5'),
      (('--config.algo.name=gspo', '--config.trainer.policy_epochs=0'), 'config.trainer.policy_epochs=0'),
      (('--config.trainer.keep_checkpoints=0',), 'config.trainer.keep_checkpoints=0'),
  )
  def test_invalid_value_names_the_field(self, flags, named):
    out = _main('--config=configs/base.py', *flags, self.workdir, '--dry_run')
    self.assertNotEqual(out.returncode, 0)
    self.assertIn(named, out.stderr)

  def test_dry_run_builds_the_mesh_on_the_devices_present(self):
    out = _main('--config=configs/base.py', '--config.mesh.fsdp=3', self.workdir, '--dry_run',
                devices=8)
    self.assertNotEqual(out.returncode, 0)
    self.assertIn('config.mesh.fsdp=3', out.stderr)
    self.assertIn('covers 3 of the 8 devices', out.stderr)
    out = _main('--config=configs/base.py', '--config.mesh.fsdp=4', '--config.mesh.data=2', self.workdir,
                '--dry_run', devices=8)
    self.assertEqual(out.returncode, 0, out.stderr)
    self.assertIn("learner mesh: {'data': 2, 'fsdp': 4, 'tensor': 1} over 8 device(s)", out.stdout)
    self.assertIn("actor mesh: the learner's (shared by reference)", out.stdout)
    out = _main('--config=configs/base.py', '--config.mesh.actor_devices=2', '--config.trainer.batch_size=12',
                self.workdir, '--dry_run', devices=8)
    self.assertEqual(out.returncode, 0, out.stderr)
    self.assertIn("learner mesh: {'data': 1, 'fsdp': 6, 'tensor': 1} over 6 device(s) [2, 3, 4, 5, 6, 7]",
                  out.stdout)
    self.assertIn("actor mesh: {'data': 1, 'fsdp': 1, 'tensor': 2} over 2 device(s) [0, 1]", out.stdout)
    out = _main('--config=configs/base.py', '--config.mesh.actor_devices=2', self.workdir, '--dry_run', devices=8)
    self.assertNotEqual(out.returncode, 0)
    self.assertIn('config.trainer.batch_size=16 is not divisible by config.mesh.data * config.mesh.fsdp = 1 * 6',
                  out.stderr)

  def test_dry_run_needs_a_workdir_when_the_run_checkpoints(self):
    out = _main('--config=configs/base.py', '--dry_run')
    self.assertNotEqual(out.returncode, 0)
    self.assertIn("config.workdir=''", out.stderr)
    out = _main('--config=configs/base.py', '--config.trainer.checkpoint_every=0', '--dry_run')
    self.assertEqual(out.returncode, 0, out.stderr)

  def test_data_file_is_a_flag_and_must_open(self):
    out = _main('--config=configs/math.py', '--config.task.kwargs.data_file=/no/such.jsonl', self.workdir,
                '--dry_run')
    self.assertNotEqual(out.returncode, 0)
    self.assertIn('config.task.kwargs.data_file=', out.stderr)
    self.assertIn('no such file', out.stderr)
    data = os.path.join(tempfile.mkdtemp(), 'p.jsonl')
    with open(data, 'w') as f:  # A code problem (--dry_run reads the rows: a math row would be refused).
      f.write('{"task_id": "t1", "prompt": "Add one.", "entry_point": "inc", "tests": [{"input": [1], "output": 2}]}\n')
    out = _main('--config=configs/code.py', f'--config.task.kwargs.eval_file={data}', self.workdir, '--dry_run')
    self.assertEqual(out.returncode, 0, out.stderr)
    self.assertIn(f'eval_file: {data}', out.stdout)

  def test_dry_run_reports_every_row_the_run_would_skip(self):
    # --dry_run did not open the data files: these rows passed it, and the run skipped them (or, the too-long
    # prompt, failed on it in every actor) without naming them there.
    data = os.path.join(tempfile.mkdtemp(), 'p.csv')
    rows = [b'id,problem,answer', b'p1,What is 1 + 1?,2', b'p2,What is 2 + 2?,', b'p3,What is caf\xe9 + 3?,4',
            b'p1,What is 4 + 4?,8', b'p5,What is 5 + 5?', b'p6,' + b'x' * 100_000 + b',6', b'p7,What is 7 + 7?,14',
            b'p8,What is 8 + 8?,16']
    with open(data, 'wb') as f:
      f.write(b'\n'.join(rows) + b'\n')
    out = _main('--config=configs/math.py', f'--config.task.kwargs.data_file={data}', '--config.task.eval_size=1',
                self.workdir, '--dry_run')
    self.assertEqual(out.returncode, 0, out.stderr)
    for row, why in ((2, "field 'answer' must be a non-empty string"), (3, "invalid UTF-8 in column 'problem'"),
                     (4, "duplicate id 'math:p1' (first at row 1)"), (5, "missing field 'answer'"),
                     (6, 'does not fit config.sampler.max_seq_len=768')):
      self.assertRegex(out.stdout, f'(?m)^ +{re.escape(data)} row {row}: .*{re.escape(why)}')
    self.assertIn(f'config.task.kwargs.data_file={data}: 8 rows, 3 used, 5 skipped', out.stdout)
    out = _main('--config=configs/math.py', self.workdir, '--dry_run')  # The shipped sample: nothing skipped.
    self.assertEqual(out.returncode, 0, out.stderr)
    self.assertIn('no rows skipped', out.stdout)

  def test_dry_run_refuses_a_data_file_with_no_valid_row(self):
    data = os.path.join(tempfile.mkdtemp(), 'p.jsonl')
    with open(data, 'w') as f:
      f.write('{"id": "1", "problem": "1+1?"}\nnot json\n')
    out = _main('--config=configs/math.py', f'--config.task.kwargs.data_file={data}', self.workdir, '--dry_run')
    self.assertNotEqual(out.returncode, 0)
    last = out.stderr.strip().splitlines()[-1]
    self.assertStartsWith(last, f"FATAL bad config: config.task.kwargs.data_file={data!r}: no valid row among 2")


if __name__ == '__main__':
  absltest.main()
