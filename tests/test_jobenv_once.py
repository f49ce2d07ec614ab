"""The job environment is chosen once, at the start (trainers.launch), and handed on: DistEnv carries it, the stop
protocol (preemption.STATE.job), standby, the process group and a script's account use it. Asked again after the
launcher exported RANK/WORLD_SIZE, `trainers.jobenv.current()` took a single process for a torchrun rank: a script's
account under a launch of one read its DistEnv as `torchrun` (the old code, run once: this file's tests failed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcjobs.protocol.contract import LaunchContract
from hpcjobs.protocol.states import StopReason
from trainers import jobenv, preemption, standby
from trainers.distenv import from_environ

REPO = Path(__file__).resolve().parent.parent
SCRIPT = """
from trainers.integrations.account import Account
account = Account()
account.begin(0)
print("source", account.env.source if account.env else None, flush=True)
account.end()
"""


@pytest.fixture(autouse=True)
def _clean() -> object:
    preemption.reset()
    yield
    preemption.reset()
    standby.reset()


def test_the_starts_choice_survives_the_launchers_export(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [k for k in os.environ if k.startswith("SLURM_") or k in ("RANK", "WORLD_SIZE")]:
        monkeypatch.delenv(name)
    env = from_environ(os.environ)
    assert env.source == "single" and env.job is not None and env.job.name == "single"
    preemption.choose(env.job)
    for name, value in env.as_env().items():  # what the launcher exports
        monkeypatch.setenv(name, value)
    assert jobenv.current().name == "torchrun"  # asked again, the kind changes
    assert preemption.job_env() is env.job
    assert from_environ(os.environ, preemption.STATE.job).source == "single"


def test_the_stop_protocol_asks_the_chosen_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Slurm job chosen at the start stays Slurm's for the stop's reason, whatever os.environ says later."""
    for name in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    preemption.choose(jobenv.current({"SLURM_JOB_ID": "77"}))
    contract = LaunchContract(run_dir=preemption.NO_RUN_FOLDER)
    assert preemption.stop_reason(contract, unasked=True) == StopReason.SIGNAL  # scheduled: Slurm's job
    assert preemption.stop_reason(contract, {}, unasked=True) == StopReason.INTERRUPT  # an env given: its own
    preemption.reset()
    assert preemption.stop_reason(contract, unasked=True) == StopReason.INTERRUPT  # outside a launch: os.environ


def test_a_launched_scripts_account_keeps_the_starts_choice(tmp_path: Path) -> None:
    """A launch of one process (no scheduler, no launcher): the script's own account reads the start's `single`,
    not the `torchrun` that the launcher's exported RANK/WORLD_SIZE would make of it."""
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HPCJOBS_", "TORCHELASTIC_"))
               and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-m", "trainers.launch", "--run-dir", str(tmp_path / "run"),
                          "--kind", "script", str(script)], cwd=REPO, env=environ, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "source single" in out.stdout, out.stdout


def test_the_process_group_takes_the_launchers_distenv(monkeypatch: pytest.MonkeyPatch) -> None:
    """run_task hands the launcher's DistEnv to distributed(): nothing is read again from os.environ (here a layout
    that would be refused if it were)."""
    from trainers.dist import distributed

    for name in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("HPCJOBS_BACKEND", "gloo")
    env = from_environ({})
    monkeypatch.setenv("RANK", "7")
    monkeypatch.setenv("WORLD_SIZE", "2")  # rank 7 of 2: from_environ(os.environ) raises
    with distributed(env=env) as ctx:
        assert ctx.env is env and ctx.world_size == 1
