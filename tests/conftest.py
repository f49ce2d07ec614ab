"""Shared fixtures. Tests marked `cluster` need the real Slurm test cluster: run them through
`tests/run_all.sh` (or `tests/cluster/testcluster.sh up` and `tests/cluster/testcluster.sh exec pytest ...`).
Where the cluster cannot run they skip with the reason; under CI=true they fail instead."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
TESTCLUSTER = REPO / "tests" / "cluster" / "testcluster.sh"
BIN = Path(sys.executable).parent


def _cluster_problem() -> str | None:
    if os.geteuid() != 0:
        return "the Slurm test cluster needs root (network namespaces, bind mounts)"
    if not os.environ.get("HPCJOBS_TEST_CLUSTER"):
        if not shutil.which("apt-get") and not shutil.which("slurmctld"):
            return "no apt-get to install Slurm and no slurmctld"
        return ("not running inside the test cluster's login namespace: run `bash tests/run_all.sh`, or "
                "`tests/cluster/testcluster.sh up` then `tests/cluster/testcluster.sh exec .venv/bin/pytest ...`")
    ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True)
    if ping.returncode != 0 or "UP" not in ping.stdout:
        return f"the test cluster does not answer scontrol ping: {ping.stdout.strip()} {ping.stderr.strip()}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    needs = [item for item in items if "cluster" in item.keywords]
    if not needs:
        return
    problem = _cluster_problem()
    if problem is None:
        return
    in_ci = os.environ.get("CI", "").lower() == "true"
    for item in needs:
        if in_ci:
            item.add_marker(pytest.mark.usefixtures("_cluster_missing_in_ci"))
        else:
            item.add_marker(pytest.mark.skip(reason=problem))
    config._cluster_problem = problem  # type: ignore[attr-defined]


FAST_TIER_LIMIT_S = float(os.environ.get("HPCJOBS_FAST_LIMIT_S", "6"))
"""The fast tier (tests/fast.sh sets HPCJOBS_FAST_TIER=1) fails on a test that ran longer than this and is marked
neither `train` nor `slow`: the tier stays the few minutes docs/testing.md says (from a fresh clone on this idle
2-core machine the slowest unmarked test took 4.6 s, the next 3.9 s). On a machine busier than its cores
(the load average over the CPU count, above 1) the limit stretches by that ratio: with four sessions' tests on this
2-core machine (load ~8) a 2 s test took 8-12 s."""
_slow_in_fast_tier: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if os.environ.get("HPCJOBS_FAST_TIER") != "1" or report.when == "teardown":
        return
    busy = max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))
    if report.duration > FAST_TIER_LIMIT_S * busy:
        _slow_in_fast_tier.append(f"{report.nodeid} ({report.when}): {report.duration:.1f} s (limit "
                                  f"{FAST_TIER_LIMIT_S * busy:.0f} s)")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _slow_in_fast_tier:
        print(f"\nslower than the fast tier's {FAST_TIER_LIMIT_S:g} s and not marked `train` (or `slow`): "
              + "; ".join(_slow_in_fast_tier) + ". HINT: mark it @pytest.mark.train, or make it faster.")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture
def _cluster_missing_in_ci(request: pytest.FixtureRequest) -> None:
    pytest.fail(f"CI=true and the Slurm test cluster is missing: {request.config._cluster_problem}")  # type: ignore


@pytest.fixture(autouse=True)
def hpcjobs_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test gets its own job store."""
    home = tmp_path / "hpcjobs-home"
    monkeypatch.setenv("HPCJOBS_HOME", str(home))
    return home


@pytest.fixture(autouse=True)
def login_user(monkeypatch: pytest.MonkeyPatch) -> None:
    """USER as a login shell sets it: the shipped profiles' runs_dir names it (/shared/$USER/runs), and a variable
    that is not set is refused (CI's containers and this machine's sessions run without it)."""
    if not os.environ.get("USER"):
        import pwd

        monkeypatch.setenv("USER", pwd.getpwuid(os.getuid()).pw_name)


SLURM_COMMANDS = ("sbatch", "squeue", "sacct", "sacctmgr", "scancel", "scontrol", "sinfo", "srun", "salloc")


@pytest.fixture(scope="session")
def no_slurm_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("no-slurm")
    for name in SLURM_COMMANDS:
        (folder / name).write_text(f'#!/bin/sh\necho "{name}: command not found" >&2\nexit 127\n')
        (folder / name).chmod(0o755)
    return folder


@pytest.fixture(autouse=True)
def no_slurm_on_path(request: pytest.FixtureRequest, no_slurm_folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside the cluster tests, Slurm's commands answer "command not found" whatever this machine has: a machine
    with Slurm's client tools but no reachable controller (or the test cluster's login namespace, where job 4242 may
    exist) must not change a test's answer. `sbatch_shim` puts its fake in front of these."""
    if "cluster" not in request.keywords:
        monkeypatch.setenv("PATH", f"{no_slurm_folder}:{os.environ['PATH']}")


@pytest.fixture
def shared_tmp() -> Any:
    """A fresh folder every node sees (the nodes share this machine's filesystem; pytest's tmp is 0700)."""
    path = Path(f"/tmp/hpcjobs-test-{os.getpid()}-{time.monotonic_ns()}")
    path.mkdir(parents=True)
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def profile_folder(path: Path) -> Path:
    """`path` made as a folder every node sees, holding profile.yaml: the test cluster's profile with its run folders
    under `path/runs`."""
    path.mkdir(exist_ok=True)
    path.chmod(0o755)
    data = yaml.safe_load((REPO / "cluster_profiles" / "testcluster.yaml").read_text())
    data["runs_dir"] = str(path / "runs")
    (path / "profile.yaml").write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def cluster_profile(shared_tmp: Path) -> Path:
    """The test cluster's profile, with its run folders in this test's own folder."""
    data = yaml.safe_load((REPO / "cluster_profiles" / "testcluster.yaml").read_text())
    data["runs_dir"] = str(shared_tmp / "runs")
    path = shared_tmp / "testcluster.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def sbatch_shim(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> Path:
    """A fake `sbatch` first on PATH running `body` (sh): for edge cases of argument and environment handling, where
    a fake is fine; it proves what reached sbatch, or that nothing did. Returns its folder."""
    folder = tmp_path / "shim"
    folder.mkdir(exist_ok=True)
    (folder / "sbatch").write_text(f"#!/bin/sh\n{body}")
    (folder / "srun").write_text("#!/bin/sh\necho 'the test shim has no srun' >&2; exit 1\n")  # submitit looks for it
    for name in ("sbatch", "srun"):
        (folder / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}:{os.environ['PATH']}")
    return folder


def newest_log(run: Path, rank: int = 0) -> str:
    """A rank's log of the newest start in a run folder (a resume, local or requeued, has logs of its own)."""
    newest = max((run / "logs").glob("restart-*"), key=lambda p: int(p.name.split("-", 1)[1]))
    return (newest / f"rank-{rank}.log").read_text()


def hpcjobs(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run the installed `hpcjobs` console script as a user would."""
    return subprocess.run([str(BIN / "hpcjobs"), *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, **(env or {})}, timeout=timeout)


def slurm(*args: str, check: bool = True) -> str:
    out = subprocess.run(list(args), capture_output=True, text=True, timeout=60)
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed: {out.stderr}")
    return out.stdout


def wait_for_state(job_id: str, states: set[str], timeout: float = 300) -> str:
    """Poll sacct/squeue until the job is in one of `states`; returns that state."""
    deadline = time.time() + timeout
    state = ""
    while time.time() < deadline:
        q = subprocess.run(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T"], capture_output=True,
                           text=True)
        state = q.stdout.strip()
        if not state:
            a = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"], capture_output=True,
                               text=True)
            state = a.stdout.strip().split(" ")[0] if a.returncode == 0 else ""
        if state in states:
            return state
        time.sleep(1)
    raise AssertionError(f"job {job_id} did not reach {states} within {timeout} s (last: {state!r})")


def accounted(job_id: str, fields: str, timeout: float = 60) -> str:
    """sacct's `fields` of the job (-X -P) once accounting has its end: squeue can say FAILED before slurmdbd has
    the job's end, when sacct still says RUNNING with ExitCode 0:0 (seen in CI)."""
    deadline = time.time() + timeout
    while True:
        state = slurm("sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State").strip()
        if state and state.split()[0] not in ("PENDING", "RUNNING", "REQUEUED", "RESIZING", "SUSPENDED"):
            return slurm("sacct", "-n", "-X", "-P", "-j", job_id, "-o", fields).strip()
        if time.time() > deadline:
            raise AssertionError(f"sacct did not record job {job_id}'s end within {timeout} s (last: {state!r})")
        time.sleep(0.5)


def wait_for_step(run: Path, step: int, timeout: float = 180) -> None:
    """Until the run's heartbeat says it reached `step` (a job mid-run, for a signal to interrupt)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if json.loads((run / "heartbeat.json").read_text())["step"] >= step:
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.3)
    raise AssertionError(f"{run} never reached step {step}")


def on_every_node(*argv: str, here: bool = True, check: bool = True) -> None:
    """Run `argv` (a mount, usually) on every node of the test cluster, in its slurmd's mount namespace (the job
    steps inherit it: each node is a mount namespace of its own), and with `here` in the tests' own too."""
    pid_files = (Path(os.environ["HPCJOBS_TEST_CLUSTER"]) / "run").glob("slurmd-*.pid")
    places = [*([[]] if here else []), *(["nsenter", "-t", p.read_text().strip(), "-m"] for p in pid_files)]
    for place in places:
        subprocess.run([*place, *argv], check=check, capture_output=True)
