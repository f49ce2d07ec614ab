#!/usr/bin/env bash
# The fast tier, for your own loop while developing: lint, types, and the tests that need neither the Slurm test
# cluster nor training runs (markers `cluster`, `slow`, `gpu` and `train` left out). Uses the environment
# tests/run_all.sh made (.venv); it sets up nothing. The full suite, as CI runs it, stays `bash tests/run_all.sh`.
# A test that takes longer than HPCJOBS_FAST_LIMIT_S (6 s) without a `train` mark fails it (tests/conftest.py).
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
for tool in ruff mypy pytest; do
    if [ ! -x ".venv/bin/$tool" ]; then
        echo "tests/fast.sh: .venv/bin/$tool is missing; valid: a .venv with the dev extra. HINT: .venv/bin/pip install -e '.[dev]' (or bash tests/run_all.sh, which makes everything)" >&2
        exit 2
    fi
done
.venv/bin/ruff check .
# pycodestyle's blank-line rules: ruff has them only in preview, whose other changes stay off
.venv/bin/ruff check --preview --select E301,E302,E303,E304,E305,E306 .
.venv/bin/mypy
HPCJOBS_FAST_TIER=1 exec .venv/bin/pytest -p no:cacheprovider -q --durations=5 -m "not cluster and not slow and not gpu and not train" \
    --ignore=tests/cluster "$@"
