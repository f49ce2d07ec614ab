"""Preemption and requeue end to end on the real cluster (issues 5 and 12).

For each trigger — `scontrol requeue`, `scancel --signal=USR2`, a real partition-priority preemption, the time
limit — a 2-node job started through `hpcjobs submit` and one started from a rendered script with plain `sbatch` are
interrupted at least once, come back by themselves, finish COMPLETED, and end with final weights bit-identical to an
uninterrupted run of the same config; under --strategy ddp and fsdp (sharded, asynchronous periodic saves). CI runs
a partition-priority preemption under fsdp and `scontrol requeue` under ddp (submit path), and a time-limit signal
while the ranks start (rendered path); `scancel --signal=USR2` through submit is CI's own-script case here (the
trainer's stop on USR2 is what a preemption sends it too); the rest run with -m slow.
Each case reports the steps lost and the seconds from signal to committed
checkpoint (printed, and appended to $HPCJOBS_REPORT_DIR/preemption.jsonl when set)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml

from conftest import REPO, hpcjobs, slurm, wait_for_state, wait_for_step
from trainers import checkpoint
from trainers.checkpoint.dcp_files import model_weights

pytestmark = pytest.mark.cluster
STEPS = {"ddp": 500, "fsdp": 250}  # ~20 s and ~30 s of training here: a trigger at step 100 lands well before the end
TIME_LIMIT_STEPS = {"ddp": 500, "fsdp": 400}  # slowed steps that must outlast a signal 30-60 s into a start
CONFIG = ["trainers.tasks.lm", "--size", "tiny", "--dropout", "0.1", "--seed", "3", "--log-every", "10"]


def config(strategy: str, steps: int | None = None) -> list[str]:
    steps = steps or STEPS[strategy]
    return [*CONFIG, "--steps", str(steps), "--ckpt-every", str(steps // 5), "--strategy", strategy]


DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


def make_profile(folder: Path, env: dict[str, str] | None = None, **preemption: int) -> Path:
    data = yaml.safe_load((REPO / "cluster_profiles" / "testcluster.yaml").read_text())
    data["runs_dir"] = str(folder / "runs")
    data["preemption"].update(preemption)
    data["env"].update(env or {})
    name = "-".join([*(f"{k}{v}" for k, v in preemption.items()), *(env or {})]) or "default"
    path = folder / f"profile-{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def start(path: str, profile: Path, run: Path, folder: Path, time_limit: str = "30:00",
          strategy: str = "ddp", gpus: int = 2, steps: int | None = None) -> str:
    common = ["--profile", str(profile), "--nodes", "2", "--gpus", str(gpus), "--time", time_limit, "--run-dir",
              str(run)]
    if path == "submit":
        out = hpcjobs("submit", *common, "--json", *config(strategy, steps), cwd=REPO)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)["job_id"]
    script = folder / f"{run.name}.sbatch"
    out = hpcjobs("render", *common, "-o", str(script), *config(strategy, steps), cwd=REPO)
    assert out.returncode == 0, out.stderr
    return slurm("sbatch", "--parsable", str(script)).strip()


def weights(run: Path, strategy: str = "ddp", steps: int | None = None) -> dict[str, torch.Tensor]:
    ref = checkpoint.latest(run / "checkpoints")
    assert ref is not None and ref.step == (steps or STEPS[strategy]), ref
    return model_weights(ref)


@pytest.fixture(scope="module")
def folder() -> Path:
    path = Path(f"/tmp/hpcjobs-preempt-{os.getpid()}")
    path.mkdir(exist_ok=True)
    path.chmod(0o755)
    return path


MADE: dict[tuple[str, int, int], dict[str, torch.Tensor]] = {}
"""The references made in this pytest process, by (strategy, GPUs a node, steps): test_container_cluster's image
runs compare with the same uninterrupted host run as the cases here (one ~25 s run, not one for each module)."""


class References:
    """The final weights of an uninterrupted run per strategy (on 2 nodes × `gpus`) and step count, made when a test
    first asks for one."""

    def __init__(self, folder: Path, gpus: int = 2) -> None:
        self.folder, self.gpus = folder, gpus

    def __call__(self, strategy: str = "ddp", steps: int | None = None) -> dict[str, torch.Tensor]:
        steps = steps or STEPS[strategy]
        key = (strategy, self.gpus, steps)
        if key not in MADE:
            name = f"reference-{strategy}{'' if self.gpus == 2 else f'-{self.gpus}gpu'}"
            run = self.folder / (name if steps == STEPS[strategy] else f"{name}-{steps}")
            job = start("submit", make_profile(self.folder), run, self.folder, strategy=strategy, gpus=self.gpus,
                        steps=steps)
            assert wait_for_state(job, DONE, timeout=400) == "COMPLETED"
            assert not any("stopped" in json.loads(ln) for ln in (run / "restarts.jsonl").read_text().splitlines())
            MADE[key] = weights(run, strategy, steps)
        return MADE[key]


@pytest.fixture(scope="module")
def references(folder: Path) -> References:
    return References(folder)


@pytest.fixture(scope="module")
def reference(references: References) -> dict[str, torch.Tensor]:
    return references("ddp")


def report(trigger: str, path: str, run: Path, job: str) -> dict[str, object]:
    """Steps lost = steps done before a stop that the next start had to redo; latency from the stop records."""
    records = [json.loads(ln) for ln in (run / "restarts.jsonl").read_text().splitlines()]
    stops = [r for r in records if "stopped" in r]
    # In restart order: restart-10 sorts before restart-2 by name.
    logs = sorted((run / "logs").glob("restart-*/rank-0.log"), key=lambda p: int(p.parent.name.split("-")[1]))
    resumed = []
    for log in logs[1:]:
        m = re.search(r"resumed from .* \(step (\d+),", log.read_text())
        resumed.append(int(m.group(1)) if m else 0)
    beats = [int(m.group(1)) for log in logs for m in re.finditer(r"step (\d+) \| loss", log.read_text())]
    lost = [max(0, s["step"] - r) for s, r in zip(stops, resumed, strict=False)] if stops else [max(beats, default=0)]
    row = {"trigger": trigger, "path": path, "job": job, "restarts": len(resumed),
           "reasons": [s.get("stopped") for s in stops], "signals": [s.get("signal") for s in stops],
           "steps_lost": lost, "signal_to_commit_s": [s.get("signal_to_commit_s") for s in stops]}
    print(f"PREEMPTION REPORT {json.dumps(row)}")
    if os.environ.get("HPCJOBS_REPORT_DIR"):
        with open(Path(os.environ["HPCJOBS_REPORT_DIR"]) / "preemption.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
    return row


def trigger_now(trigger: str, job: str) -> None:
    if trigger == "scontrol-requeue":
        slurm("scontrol", "requeue", job)
    elif trigger == "scancel-signal":
        slurm("scancel", "--signal=USR2", job)
    elif trigger == "preemption":
        slurm("sbatch", "--parsable", "-p", "high", "-N2", "--exclusive", "--output=/dev/null", "--wrap", "sleep 2")


TRIGGERS = ["scontrol-requeue", "scancel-signal", "preemption", "time-limit"]
IN_CI = {("ddp", "scontrol-requeue", "submit"), ("fsdp", "preemption", "submit")}
"""The rendered-sbatch path shares every line of the node side with the submit path, and both strategies share the
preemption protocol; CI runs a real preemption under fsdp and `scontrol requeue` under ddp, on the submit path
(`scancel --signal=USR2` through submit: test_own_script_with_stopguard_survives_a_signal[submit]; the USR2 a
preemption sends: the fsdp case and test_container_cluster's, ddp in an image); the
rendered path's requeue runs in test_a_time_limit_signal_that_comes_while_ranks_start... (~3 min: each time-limit
case waits out 2-minute limits); the rest run with `-m slow` (see docs/testing.md)."""
CASES = [pytest.param(s, t, p, marks=[] if (s, t, p) in IN_CI else [pytest.mark.slow], id=f"{s}-{t}-{p}")
         for s in ("ddp", "fsdp") for p in ("submit", "sbatch") for t in TRIGGERS]


@pytest.mark.parametrize("strategy,trigger,path", CASES)
def test_interrupted_job_comes_back_and_ends_bit_identical(strategy: str, trigger: str, path: str, folder: Path,
                                                           references: References) -> None:
    steps = (TIME_LIMIT_STEPS if trigger == "time-limit" else STEPS)[strategy]
    reference = references(strategy, steps)
    run = folder / f"{strategy}-{trigger}-{path}"
    if trigger == "time-limit":
        # Slurm keeps limits in whole minutes and sends the signal at a check every 30 s once `seconds_before` is
        # reached: 2:00 with 90 s cuts each start 0-30 s in (ddp); fsdp's steps are slower here (30 s would be mostly
        # start-up): 3:00 with 120 s, 30-60 s in. (3:00 with 90 s came 60-90 s in: all 400 steps were done by then
        # on a quiet machine, which proved nothing.)
        # Each step is also made longer (HPCJOBS_FAULT_SLOW_STEP) so that a run takes longer than the latest
        # signal whatever this machine's speed: on a fresh VM all 400 fsdp steps took 41 s, done before the signal.
        lead, limit, slow = (120, "3:00", "0.2") if strategy == "fsdp" else (90, "2:00", "0.1")
        profile = make_profile(folder, env={"HPCJOBS_FAULT_SLOW_STEP": slow}, seconds_before=lead, max_restarts=30)
        job = start(path, profile, run, folder, time_limit=limit, strategy=strategy, steps=steps)
    else:
        job = start(path, make_profile(folder), run, folder, strategy=strategy, steps=steps)
        wait_for_step(run, 100)
        trigger_now(trigger, job)
    assert wait_for_state(job, DONE, timeout=900) == "COMPLETED"
    row = report(f"{strategy}-{trigger}", path, run, job)
    assert row["restarts"] >= 1, row
    got = weights(run, strategy, steps)
    assert got.keys() == reference.keys() and all(torch.equal(got[k], reference[k]) for k in got)
    final = json.loads((run / "final.json").read_text())
    assert final["state"] == "finished"
    # Logs of every restart are kept, none overwritten.
    assert sorted(p.name for p in (run / "logs").iterdir())[:2] == ["restart-0", "restart-1"]
    assert "restart 1" in (run / "logs" / "restart-1" / "rank-0.log").read_text()
    assert not [p for p in (run / "logs").rglob("rank-*.log") if "Bypassing signal" in p.read_text()]  # submitit's
    assert row["steps_lost"] == [0] * len(row["steps_lost"]), row
    expected = {"time-limit": "timeout", "scontrol-requeue": "terminated"}.get(trigger, "preemption")
    assert set(row["reasons"]) == {expected}, row


@pytest.mark.parametrize("path", ["submit", pytest.param("sbatch", marks=pytest.mark.slow)])
def test_preemption_by_sigterm_without_the_user_signal(path: str, folder: Path,
                                                       reference: dict[str, torch.Tensor]) -> None:
    """Slurm without preempt_send_user_signal sends SIGTERM at preemption and requeues only a job still running
    when GraceTime ends: the trainer must see that it was preempted and requeue itself after saving."""
    env = {**os.environ, "HPCJOBS_CLUSTER_USER_SIGNAL": "0"}
    try:
        subprocess.run([str(REPO / "tests" / "cluster" / "testcluster.sh"), "restart"], check=True, env=env,
                       capture_output=True)
        run = folder / f"preemption-sigterm-{path}"
        job = start(path, make_profile(folder), run, folder)
        wait_for_step(run, 100)
        trigger_now("preemption", job)
        assert wait_for_state(job, DONE, timeout=600) == "COMPLETED"
        row = report("preemption-sigterm", path, run, job)
        assert row["restarts"] == 1 and row["signals"] == ["SIGTERM"], row
        assert row["reasons"] == ["preemption"] and row["steps_lost"] == [0], row
        got = weights(run)
        assert all(torch.equal(got[k], reference[k]) for k in got)
    finally:
        subprocess.run([str(REPO / "tests" / "cluster" / "testcluster.sh"), "restart"], check=True,
                       capture_output=True, env={**os.environ, "HPCJOBS_CLUSTER_USER_SIGNAL": "1"})


OWN = str(REPO / "trainers" / "examples" / "own_script.py")
OWN_STEPS = "2500"  # ~30 s here; the signal comes at step 500


def own_weights(run: Path) -> dict[str, torch.Tensor]:
    ref = checkpoint.latest(run / "checkpoints")
    assert ref is not None
    return model_weights(ref)


def wait_for_log(log: Path, text: str, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while not (log.exists() and text in log.read_text()):
        assert time.time() < deadline, f"{text!r} never appeared in {log}"
        time.sleep(0.3)


@pytest.mark.parametrize("path", ["submit", pytest.param("sbatch", marks=pytest.mark.slow)])
def test_own_script_with_stopguard_survives_a_signal(path: str, folder: Path) -> None:
    profile = make_profile(folder)
    common = ["--profile", str(profile), "--nodes", "2", "--gpus", "2"]
    ref_run, ref_job = folder / "own-reference", ""
    if not (ref_run / "done").exists():  # runs beside the interrupted job: its waits are the reference's time
        out = hpcjobs("submit", *common, "--json", "--run-dir", str(ref_run), OWN, "--steps", OWN_STEPS, cwd=REPO)
        ref_job = json.loads(out.stdout)["job_id"]
    run = folder / f"own-{path}"
    if path == "submit":
        out = hpcjobs("submit", *common, "--json", "--run-dir", str(run), OWN, "--steps", OWN_STEPS, cwd=REPO)
        job = json.loads(out.stdout)["job_id"]
    else:
        script = folder / "own.sbatch"
        assert hpcjobs("render", *common, "-o", str(script), "--run-dir", str(run), OWN, "--steps", OWN_STEPS,
                       cwd=REPO).returncode == 0
        job = slurm("sbatch", "--parsable", str(script)).strip()
    wait_for_log(run / "logs" / "restart-0" / "rank-0.log", "step 500 ")
    slurm("scancel", "--signal=USR2", job)
    assert wait_for_state(job, DONE, timeout=300) == "COMPLETED"
    if ref_job:
        assert wait_for_state(ref_job, DONE) == "COMPLETED"
        assert not any("stopped" in ln for ln in (ref_run / "restarts.jsonl").read_text().splitlines())
        (ref_run / "done").touch()
    log1 = (run / "logs" / "restart-1" / "rank-0.log").read_text()
    assert "resumed from" in log1 and f"done at step {OWN_STEPS}" in log1
    a, b = own_weights(ref_run), own_weights(run)  # the script settles DDP's buckets: bit-identical, as the trainer
    assert all(torch.equal(a[k], b[k]) for k in a), {k: (a[k] - b[k]).abs().max().item() for k in a}


SLOW_FIRST_START = """import os, time
if os.environ.get("SLURM_RESTART_COUNT", "0") == "0" and os.environ.get("SLURM_STEP_ID"):
    time.sleep(40)  # a rank's startup (imports, a container) that outlasts Slurm's early time-limit signal
"""
"""Only in the processes srun starts (SLURM_STEP_ID: the ranks), not in the batch script's own Pythons (the nodes'
Python check, the recovery's supervisor), whose environment has SLURM_PROCID=0 too: with them asleep as well, the
ranks reached their first step 128 s into a 120 s limit and Slurm ended the job before the deadline's stop (seen in
CI once, when Slurm's once-a-30-s limit check came early; the earlier runs passed on that check's lateness)."""


# CI runs the rendered script's path (~5 min); the submit path shares the node side and runs with -m slow.
@pytest.mark.parametrize("path", [pytest.param("submit", marks=pytest.mark.slow), "sbatch"])
def test_a_time_limit_signal_that_comes_while_ranks_start_neither_kills_nor_is_missed(
        path: str, folder: Path, reference: dict[str, torch.Tensor]) -> None:
    """Slurm sends the time-limit signal at its first periodic check (every 30 s) once the job is within
    `seconds_before` plus up to a minute of the limit: with 2:00 and 90 s, 0-30 s into each start. Here the first
    start's ranks take 40 s to reach their handler, so that signal lands on starting ranks. Unguarded it killed them
    (job FAILED, measured); ignored, it is lost, and the ranks must still stop in time by themselves."""
    slow = folder / "slow-start"
    slow.mkdir(exist_ok=True)
    (slow / "sitecustomize.py").write_text(SLOW_FIRST_START)
    run = folder / f"slow-start-{path}"
    profile = make_profile(folder, env={"PYTHONPATH": str(slow)}, seconds_before=90, max_restarts=30)
    job = start(path, profile, run, folder, time_limit="2:00")
    assert wait_for_state(job, DONE, timeout=900) == "COMPLETED"
    row = report("slow-start", path, run, job)
    assert row["restarts"] >= 1 and row["reasons"][0] == "timeout", row
    assert row["signals"][0] == "deadline", row  # Slurm's signal came during the sleep: lost, not handled
    assert row["steps_lost"] == [0] * len(row["steps_lost"]), row
    got = weights(run)
    assert got.keys() == reference.keys() and all(torch.equal(got[k], reference[k]) for k in got)
    assert "never came" in (run / "logs" / "restart-0" / "rank-0.log").read_text()
