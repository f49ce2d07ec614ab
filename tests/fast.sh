#!/usr/bin/env bash
# The fast tier, for your own loop while developing: lint, types, and the tests that need neither the Slurm test
# cluster nor training runs (markers `cluster`, `slow`, `gpu` and `train` left out). Uses the environment
# tests/run_all.sh made (.venv); it sets up nothing. The full suite, as CI runs it, stays `bash tests/run_all.sh`.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
.venv/bin/mypy
exec .venv/bin/pytest -p no:cacheprovider -q -m "not cluster and not slow and not gpu and not train" \
    --ignore=tests/cluster "$@"
