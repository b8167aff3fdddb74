"""One process of the 2-process learner test (run by learner_test.MultiProcessTest, not by pytest).

Usage: python -m tests.learner.mp_worker PORT PROCESS_ID OUT_DIR, with 2 CPU devices per process
(XLA_FLAGS=--xla_force_host_platform_device_count=2). Both processes form a global mesh of 4
(fsdp=2 x tensor=2), each feeds only its own rows of the batch, and process 0 writes the parameters
and metrics after two SAO steps.
"""

import json
import os
import sys


def main(port: str, process_id: str, out: str) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from sao_jax import parallel  # pylint: disable=g-import-not-at-top
  from sao_jax.learner import Learner, LearnerConfig  # pylint: disable=g-import-not-at-top
  from tests.learner import helpers as H  # pylint: disable=g-import-not-at-top

  config = H.config('sao', **H.SAO_OVERRIDES)
  config.distributed.coordinator_address = f'127.0.0.1:{port}'
  config.distributed.num_processes = 2
  config.distributed.process_id = int(process_id)
  assert parallel.initialize(config.distributed, timeout_s=120)
  assert jax.process_count() == 2 and jax.device_count() == 4, (jax.process_count(), jax.device_count())
  mesh = parallel.make_mesh(dict(data=1, fsdp=2, tensor=2))
  learner = Learner(LearnerConfig.from_config(config), policy=H.policy_fn()(), mesh=mesh, model_config=H.MODEL)
  start, stop = parallel.local_row_range(H.B, mesh)
  assert stop - start == H.B // 2, (start, stop)
  metrics = {}
  for i in range(2):
    local = jax.tree.map(lambda x, s=start, e=stop: x[s:e], H.batch(i))  # This process's rows only.
    metrics[f'step{i}'] = learner.update(local)
  arrays = {f'policy:{k}': v for k, v in H.leaves_with_paths(learner.state.policy.params).items()}
  arrays.update({f'critic:{k}': v for k, v in H.leaves_with_paths(learner.state.critic.params).items()})
  if parallel.is_main_process():
    np.savez(os.path.join(out, 'params.npz'), **arrays)
    metrics.update(devices=jax.device_count(), processes=jax.process_count())
    with open(os.path.join(out, 'metrics.json'), 'w') as f:
      json.dump(metrics, f)
  jax.distributed.shutdown()


if __name__ == '__main__':
  main(*sys.argv[1:4])
