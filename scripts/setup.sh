#!/usr/bin/env bash
# Sets up a fresh clone: bubblewrap (the sandbox that runs model-written code, see the README's Security
# model) and a Python 3.11 virtual environment in .venv with the pinned requirements.
#   scripts/setup.sh          runtime requirements
#   scripts/setup.sh --test   runtime and test requirements (torch CPU, transformers, pytest, libtpu)
#   scripts/setup.sh --tpu    runtime requirements and libtpu (a TPU VM; or any host, to plan a pod run)
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v bwrap >/dev/null 2>&1; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  if command -v apt-get >/dev/null 2>&1; then
    ($sudo apt-get update -qq && $sudo apt-get install -y -qq bubblewrap >/dev/null) \
      || echo "setup.sh: could not install bubblewrap; the code task and its sandbox tests need it" >&2
  else
    echo "setup.sh: install bubblewrap (bwrap) with your package manager; the code task needs it" >&2
  fi
fi
python3.11 -m venv .venv
. .venv/bin/activate
reqs=(-r requirements.txt)
[ "${1:-}" = "--test" ] && reqs+=(-r requirements-test.txt)
[ "${1:-}" = "--tpu" ] && reqs+=(-r requirements-tpu.txt)
pip install -q "${reqs[@]}"
