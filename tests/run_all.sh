#!/usr/bin/env bash
# Set up everything on a fresh machine and run every test:
#   the virtual environment (.venv), torch from the local CPU wheel first (pip install torch==2.13.0; otherwise pip
#   would pull the multi-GB CUDA build), hpcjobs installed from a built wheel (not editable), the real Slurm test
#   cluster (Debian's packages, installed if missing), then pytest on the cluster's login node. The cluster is torn
#   down on exit, also when tests fail. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$SECONDS
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -c 'import torch' 2>/dev/null || .venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q --upgrade --force-reinstall --no-deps . >/dev/null
.venv/bin/pip install -q . '.[dev,docs]' >/dev/null   # the dependencies (torch is already satisfied)
# The wheel, installed in a fresh virtual environment outside the repo (the cluster's namespaces reach no index,
# so this happens here); tests/cluster/test_submit_cluster.py renders and submits from it.
export HPCJOBS_WHEEL_VENV=${HPCJOBS_WHEEL_VENV:-/tmp/hpcjobs-wheel-venv}
rm -rf "$HPCJOBS_WHEEL_VENV" /tmp/hpcjobs-wheel-dist
.venv/bin/pip wheel -q --no-deps -w /tmp/hpcjobs-wheel-dist . >/dev/null
"$PY" -m venv "$HPCJOBS_WHEEL_VENV"
"$HPCJOBS_WHEEL_VENV/bin/pip" install -q torch==2.13.0
"$HPCJOBS_WHEEL_VENV/bin/pip" install -q /tmp/hpcjobs-wheel-dist/hpcjobs-*.whl
echo "[run_all] environment ready in $((SECONDS - t0)) s"

# Lint and types first: a minute here is cheaper than a red run after half an hour of cluster tests.
t2=$SECONDS
.venv/bin/ruff check .
# pycodestyle's blank-line rules: ruff has them only in preview, whose other changes stay off
.venv/bin/ruff check --preview --select E301,E302,E303,E304,E305,E306 .
.venv/bin/mypy
# The docs site, strictly: a broken link or anchor, or a page left off the nav, fails here (mkdocs.yml). Not
# --quiet: it hides the warnings from strict mode too, and a broken link passed.
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir /tmp/hpcjobs-site
echo "[run_all] ruff + mypy + docs site clean in $((SECONDS - t2)) s"

# The README's first command, as typed, in a fresh clone, then its "run it again" command (here: the cluster's
# namespaces reach no package index).
t3=$SECONDS
"$PY" tests/readme_quickstart.py /tmp/hpcjobs-quickstart
echo "[run_all] README quickstart as typed in $((SECONDS - t3)) s"

trap 'tests/cluster/testcluster.sh down' EXIT
t1=$SECONDS
tests/cluster/testcluster.sh up
echo "[run_all] cluster up in $((SECONDS - t1)) s (setup so far $((SECONDS - t0)) s)"

# Tests run on the cluster's login node (the head namespace), where sbatch/squeue reach slurmctld.
set +e
tests/cluster/testcluster.sh exec env -C "$PWD" PATH="$PWD/.venv/bin:$PATH" .venv/bin/pytest -p no:cacheprovider --durations=60 "$@"
rc=$?
set -e
echo "[run_all] total $((SECONDS - t0)) s"
exit $rc
