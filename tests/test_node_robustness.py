"""Issue 10 on the node side: a new user's first hour has no traceback on the terminal, and no mistake destroys a run.

Ranks are started here the way the local backend starts them (one `python -m trainers.launch` per rank, gloo on the
CPU; when one fails the others are stopped, like srun --kill-on-bad-exit), so these tests need no submit side."""

from __future__ import annotations

import io
import json
import math
import os
import pty
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from hpcjobs.protocol.ports import free_port
from hpcjobs.protocol.runfolder import RunFolder
from hpcjobs.protocol.settings.trainconfig import TrainConfig
from trainers import checkpoint
from trainers.checkpoint.dcp_files import model_weights
from trainers.dist import DistContext
from trainers.distenv import DistEnv
from trainers.task import Task

REPO = Path(__file__).resolve().parent.parent
CLASSIFIER = ["trainers.tasks.classifier", "--samples", "512", "--hidden", "32"]


@dataclass
class Rank:
    rc: int
    out: str
    err: str


def clean_env(**extra: str) -> dict[str, str]:
    drop = ("SLURM_", "HPCJOBS_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    return {**env, "OMP_NUM_THREADS": "1", "HPCJOBS_FAULT_INJECT": "", **extra}


def start(run_dir: Path, args: list[str], ranks: int = 1, job: str = "job-a", fault: str = "",
          cwd: Path = REPO, **env: str) -> tuple[list[subprocess.Popen[str]], Path]:
    """Every rank of one job through the launcher, output into files (a pipe could fill up while we wait)."""
    port, out_dir = free_port(), Path(f"{run_dir}-{job}-out-{time.monotonic_ns()}")
    out_dir.mkdir(parents=True)
    procs = []
    for r in range(ranks):
        rank_env = clean_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks),
                             MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), HPCJOBS_JOB_ID=job,
                             HPCJOBS_FAULT_INJECT=fault, **env)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "trainers.launch", "--run-dir", str(run_dir), "--", *args], cwd=cwd,
            env=rank_env, text=True, stdout=open(out_dir / f"{r}.out", "w"), stderr=open(out_dir / f"{r}.err", "w")))
    return procs, out_dir


def finish(procs: list[subprocess.Popen[str]], out_dir: Path, timeout: float = 300) -> list[Rank]:
    """Wait for every rank; once one fails, stop the others as the local backend does."""
    deadline = time.time() + timeout
    while any(p.poll() is None for p in procs):
        assert time.time() < deadline, "ranks did not end in time"
        if any(p.poll() not in (None, 0) for p in procs):
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            for p in procs:
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
        time.sleep(0.05)
    return [Rank(p.returncode, (out_dir / f"{r}.out").read_text(), (out_dir / f"{r}.err").read_text())
            for r, p in enumerate(procs)]


def launch(run_dir: Path, args: list[str], ranks: int = 1, **kw: str) -> list[Rank]:
    return finish(*start(run_dir, args, ranks, **kw))


def terminal(ranks: list[Rank]) -> str:
    return "".join(r.out + r.err for r in ranks)


def messages(ranks: list[Rank]) -> list[str]:
    """What the ranks told the person at the terminal, less each rank's start line and the trainer's progress."""
    return [line for line in terminal(ranks).splitlines()
            if line.startswith("hpcjobs: ") and not re.match(r"hpcjobs: rank \d+/\d+ \(local", line)]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run_text(run_dir: Path) -> str:
    """Everything in a run folder that is text, for "was this ever mentioned there"."""
    return "".join(p.read_text(errors="replace") for p in run_dir.rglob("*")
                   if p.is_file() and p.suffix not in (".pt",))


# --- 1. a corrupt newest checkpoint ------------------------------------------------------------------------------

BASE = [*CLASSIFIER, "--steps", "9", "--ckpt-every", "3", "--keep", "3", "--log-every", "3"]


@pytest.fixture(scope="module")
def finished_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """A finished run with checkpoints at steps 3, 6 and 9, with 1 and with 2 ranks."""
    runs = {}
    for ranks in (1, 2):
        run = tmp_path_factory.mktemp(f"base{ranks}") / "run"
        assert all(r.rc == 0 for r in launch(run, BASE, ranks))
        assert [ref.step for ref in checkpoint.finished(run / "checkpoints")] == [3, 6, 9]
        runs[ranks] = run
    return runs


def damage(step_dir: Path, how: str) -> None:
    if how == "shared":
        with open(step_dir / "shared.pt", "r+b") as f:
            f.truncate(100)
    elif how == "meta":
        (step_dir / "meta.json").write_text("{garbage")
    elif how == "rank-1":
        with open(step_dir / "rank-1.pt", "r+b") as f:
            f.truncate(30)
    elif how == "rank-1-missing":
        (step_dir / "rank-1.pt").unlink()
    elif how == "shards":  # the last rank's DCP file, cut in half: the load fails inside DCP, after it began
        last = max(step_dir.glob("__*_0.distcp"))
        with open(last, "r+b") as f:
            f.truncate(last.stat().st_size // 2)


@pytest.mark.train
@pytest.mark.parametrize("ranks,how", [(1, "shared"), (1, "meta"), (2, "shared"), (2, "meta"), (2, "rank-1"),
                                       (2, "rank-1-missing"), (1, "shards"), (2, "shards")])
def test_a_corrupt_newest_checkpoint_is_moved_aside_and_the_older_one_resumed(
        finished_runs: dict[int, Path], tmp_path: Path, ranks: int, how: str) -> None:
    run = tmp_path / "run"
    shutil.copytree(finished_runs[ranks], run)
    shard = max((run / "checkpoints" / "step-9").glob("__*_0.distcp")).name
    damage(run / "checkpoints" / "step-9", how)
    out = launch(run, BASE, ranks, job="job-b")
    assert [r.rc for r in out] == [0] * ranks, terminal(out)
    aside = run / "checkpoints" / "corrupt" / "step-9"
    assert (aside / "FINISHED").is_file()  # moved whole, nothing deleted
    said = [line for line in terminal(out).splitlines() if "cannot be loaded" in line]
    assert len(said) == 1 and str(aside) in said[0], said  # one line, from rank 0, saying which and why
    assert {"shared": "shared.pt", "meta": "meta.json", "rank-1": "rank 1: rank-1.pt",
            "rank-1-missing": "rank-1.pt is missing", "shards": "sharded tensors"}[how] in said[0]
    if how in ("shards", "shared"):  # the file, and torch's first sentence whole (it was cut mid-word, unnamed)
        torn = "shared.pt" if how == "shared" else shard
        assert f"{torn}: RuntimeError: PytorchStreamReader failed reading zip archive: failed finding central " \
               "directory)" in said[0], said
    assert "Traceback" not in terminal(out)
    assert "torch.distributed is disabled" not in terminal(out)  # DCP's warning, at each 1-rank load and save
    log = (run / "logs" / "restart-0" / "rank-0.log").read_text()
    assert f"resumed from {run / 'checkpoints' / 'step-6'} (step 6," in log
    assert checkpoint.latest(run / "checkpoints").step == 9
    assert json.loads((run / "final.json").read_text())["state"] == "finished"
    straight = model_weights(checkpoint.latest(finished_runs[ranks] / "checkpoints"))
    again = model_weights(checkpoint.latest(run / "checkpoints"))
    assert all(torch.equal(straight[k], again[k]) for k in straight)  # and it is the same run, exactly


@pytest.mark.train
def test_with_every_checkpoint_corrupt_the_run_starts_fresh(finished_runs: dict[int, Path], tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(finished_runs[1], run)
    for step in (3, 6, 9):
        damage(run / "checkpoints" / f"step-{step}", "meta" if step % 2 else "shared")
    out = launch(run, BASE)
    assert out[0].rc == 0, terminal(out)
    assert sorted(p.name for p in (run / "checkpoints" / "corrupt").iterdir()) == ["step-3", "step-6", "step-9"]
    assert "starting at step 0" in out[0].out
    assert [m["step"] for m in metrics(run)] == [3, 6, 9]  # the old records went with the checkpoints


def test_a_load_that_failed_halfway_lets_go_of_the_old_model_before_building_anew(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """After a load that fails halfway the model is built anew. The old model and optimizer (FSDP's hooks hold them
    in cycles) stayed alive while the new ones were built: for that moment a rank held two of each."""
    import types
    import weakref

    from trainers.checkpoint.sharded import Checkpointer
    from trainers.checkpoint.stateful import ModelState, OptimizerState
    from trainers.trainer import Training

    training = Training.__new__(Training)
    model = torch.nn.Linear(4, 4)
    model.me = model  # type: ignore[assignment]  # a cycle, as FSDP's hooks make
    optimizer = torch.optim.AdamW(model.parameters())
    training.model, training.optimizer = model, optimizer
    training.strategy, training.scaler = object(), torch.amp.GradScaler("cpu", enabled=False)  # type: ignore[assignment]
    training.ctx = types.SimpleNamespace(device=torch.device("cpu"))  # type: ignore[assignment]
    # The scheduler and the checkpoint manager's named parts hold the model and the optimizer too.
    training.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    training.checkpointer = Checkpointer(Path("unused"), training.ctx, 2, {
        "model": ModelState(model), "optimizer": OptimizerState(model, optimizer)})
    old, alive_while_building = weakref.ref(model), []
    del model, optimizer
    monkeypatch.setattr(Training, "build", lambda self: alive_while_building.append(old() is not None))
    training.rebuild()
    assert alive_while_building == [False]


# --- 2. metrics.jsonl never holds a step twice -------------------------------------------------------------------

@pytest.mark.train
def test_after_a_kill_and_a_resume_metrics_hold_each_step_once(tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = [*CLASSIFIER, "--steps", "12", "--log-every", "1", "--ckpt-every", "3", "--eval-every", "2"]
    killed = launch(run, args, 2, fault="step@8")  # checkpoint at 6, steps 7 logged after it
    assert killed[0].rc == -signal.SIGKILL
    assert max(m["step"] for m in metrics(run)) == 7
    out = launch(run, args, 2, job="job-b")  # the lock died with the killed rank: no stale lock
    assert [r.rc for r in out] == [0, 0], terminal(out)
    seen = [(m["step"], "val_loss" in m) for m in metrics(run)]
    assert len(seen) == len(set(seen)), seen
    assert sorted(s for s, val in seen if not val) == list(range(1, 13))
    assert sorted(s for s, val in seen if val) == [2, 4, 6, 8, 10, 12]


def test_trimming_metrics_drops_later_steps_and_a_torn_line(tmp_path: Path) -> None:
    from trainers.checkpoint.resume import trim_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3, 4)) + '{"step": 5, "lo')
    assert trim_metrics(path, 2) == 3
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2]
    assert trim_metrics(path, 2) == 0 and not list(tmp_path.glob(".*.tmp"))
    assert trim_metrics(tmp_path / "none.jsonl", 3) == 0


# --- 3. the run folder's lock, and refused starts leave final.json alone ------------------------------------------

@pytest.mark.train
def test_a_second_job_on_a_running_folder_is_refused_and_the_first_finishes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = [*CLASSIFIER, "--steps", "2500", "--log-every", "50", "--ckpt-every", "500"]
    first, first_out = start(run, args, 2, job="job-a")
    deadline = time.time() + 120
    while not (run / "heartbeat.json").exists():
        assert time.time() < deadline and all(p.poll() is None for p in first)
        time.sleep(0.1)
    second = launch(run, args, 2, job="job-b")
    assert all(p.poll() is None for p in first), "the first job should still be training"
    assert second[0].rc == 2
    said = terminal(second).strip().splitlines()
    assert len(said) == 1 and "is in use by job job-a" in said[0] and "HINT:" in said[0], said
    done = finish(first, first_out)
    assert [r.rc for r in done] == [0, 0], terminal(done)
    final = json.loads((run / "final.json").read_text())
    assert final["state"] == "finished" and final["job_id"] == "job-a" and final["step"] == 2500
    assert "job-b" not in run_text(run)  # not a log line, not a start record, not a lock holder


@pytest.mark.train
def test_a_refused_resume_leaves_a_finished_runs_final_json_byte_identical(finished_runs: dict[int, Path],
                                                                             tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(finished_runs[1], run)
    before = (run / "final.json").read_bytes()
    checkpoints = sorted(p.name for p in (run / "checkpoints").iterdir())
    for changed, says in (([a if a != "32" else "64" for a in BASE], "was written with other settings"),
                          ([*BASE, "--lr", "0.5"], "was written with other settings"),
                          ([*BASE, "--steps", "0"], "--steps 0 is too small"),
                          ([*BASE, "--steps", "20"], "--steps 9, this start asks for --steps 20")):
        out = launch(run, changed, job="job-b")
        assert out[0].rc == 2, terminal(out)
        said = messages(out)
        assert len(said) == 1 and says in said[0] and "Traceback" not in terminal(out), said
        assert (run / "final.json").read_bytes() == before
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == checkpoints


@pytest.mark.train
def test_a_refused_resume_on_two_ranks_is_one_line(finished_runs: dict[int, Path], tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(finished_runs[2], run)
    out = launch(run, [*BASE, "--lr", "0.5"], 2, job="job-b")
    assert [r.rc for r in out] == [2, 2]
    assert [len([x for x in (r.out + r.err).splitlines() if "other settings" in x]) for r in out] == [1, 0]
    assert "was written with other settings" in (run / "logs" / "restart-0" / "rank-1.log").read_text()


# --- 4. a failing rank: one line on the terminal, the traceback in its log, the reason in final.json --------------

FAILING_TASK = '''
import os
import torch
from torch.utils.data import TensorDataset
from trainers.task import Task

calls = [0]

def loss(model, batch):
    calls[0] += 1
    if os.environ["RANK"] == "1" and calls[0] == 3:
        raise ValueError("boom at the third batch")
    return torch.nn.functional.mse_loss(model(batch[0]), batch[1])

task = Task(name="failing", model=lambda: torch.nn.Linear(4, 1),
            train_data=lambda: TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), loss=loss)
'''


@pytest.mark.train
def test_a_rank_that_fails_prints_one_line_and_keeps_its_traceback_in_its_log(tmp_path: Path) -> None:
    (tmp_path / "failing_task.py").write_text(FAILING_TASK)
    run = tmp_path / "run"
    out = launch(run, ["failing_task", "--steps", "20"], 2, PYTHONPATH=str(tmp_path))
    assert out[1].rc == 1
    assert "Traceback" not in terminal(out)
    log1 = run / "logs" / "restart-0" / "rank-1.log"
    assert "Traceback" in log1.read_text() and 'raise ValueError("boom at the third batch")' in log1.read_text()
    final = json.loads((run / "final.json").read_text())
    assert final["state"] == "failed" and final["job_id"] == "job-a"
    # The first failure wins: rank 0's own (its peer left mid-collective) does not replace it.
    assert final["reason"] == f"rank 1 on {os.uname().nodename}: ValueError: boom at the third batch (log: {log1})"
    failures = [json.loads(line) for line in (run / "failures.jsonl").read_text().splitlines()]
    assert failures[0]["rank"] == 1 and failures[0]["error"] == "ValueError: boom at the third batch", failures
    for r in out:
        assert len([line for line in (r.out + r.err).splitlines() if "failed" in line]) <= 1, terminal(out)
    assert f"hpcjobs: rank 1 failed: ValueError: boom at the third batch (traceback in {log1})" in out[1].out


def test_the_first_failure_of_a_start_is_recorded_and_a_finished_run_is_never_overwritten(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hpcjobs.protocol.contract import LaunchContract
    from hpcjobs.protocol.states import FinalState
    from trainers import runlock
    from trainers.failures import record_failure

    run, env = RunFolder(tmp_path), DistEnv(0, 0, 1, 1, "127.0.0.1", 1, "0", 0, "single")
    run.write_final(FinalState.FAILED, "an earlier plain run (job 0 too)", job_id="0")
    time.sleep(0.01)
    runlock.take(run, env)  # this start: the lock's time says when it began
    monkeypatch.setenv("HPCJOBS_CONTRACT", LaunchContract(run_dir=str(tmp_path), start_time=time.time()).to_json())
    assert record_failure(run, env, "rank 0: first")  # an earlier start's word gives way, even a moment earlier
    assert not record_failure(run, env, "rank 0: second")  # the first failure of this start stays
    assert run.read("final")["reason"] == "rank 0: first" and run.read("final")["job_id"] == "0"
    run.write_final(FinalState.FINISHED, "reached step 9", 9, job_id="old")
    assert not record_failure(run, env, "rank 0: never trained") and run.read("final")["state"] == "finished"


@pytest.mark.train
def test_a_bad_task_flag_is_one_line_without_usage_or_traceback(tmp_path: Path) -> None:
    run = tmp_path / "run"
    out = launch(run, ["trainers.tasks.lm", "--size", "huge", "--steps", "5"], 2)
    assert [r.rc for r in out] == [2, 2]
    text = terminal(out)
    assert "Traceback" not in text and "usage:" not in text
    said = [line for line in text.splitlines() if "huge" in line]
    assert len(said) == 1, said
    assert said[0].startswith("hpcjobs: rank 0 failed: TaskArgError: trainers.tasks.lm: --size")
    assert "valid: --size 1b|7b|large|medium|small|tiny" in said[0]
    final = json.loads((run / "final.json").read_text())
    log0 = run / "logs" / "restart-0" / "rank-0.log"
    assert final["reason"].startswith(f"rank 0 on {os.uname().nodename}: TaskArgError: trainers.tasks.lm: --size: "
                                      "invalid choice: 'huge'")
    assert final["reason"].endswith(f"(log: {log0})")


def test_task_parsers_raise_one_line_errors() -> None:
    from trainers.task import TaskArgError, TaskArgParser
    from trainers.tasks import classifier, lm

    with pytest.raises(TaskArgError) as e:
        lm.make_task(["--sizee", "tiny"])
    assert "did you mean --size (a task flag)?" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(TaskArgError, match="--hidden: 'x' is not a whole number; valid: --hidden N with N ≥ 1"):
        classifier.make_task(["--hidden", "x"])
    with pytest.raises(TaskArgError, match="--text .* is not a file"):
        lm.make_task(["--text", "/nonexistent/file.txt"])
    p = TaskArgParser(prog="t")
    p.add_argument("--on", action="store_true")
    with pytest.raises(TaskArgError, match="valid: --on alone"):
        p.parse_args(["--on=1"])


PLAIN_TASK = """
import argparse, torch
from torch.utils.data import TensorDataset
from trainers.task import Task

def make_task(args):
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--n", type=int)
    p.parse_args(args)
    return Task(name="p", model=lambda: torch.nn.Linear(2, 1), train_data=lambda: TensorDataset(torch.zeros(8, 2)),
                loss=lambda m, b: m(b[0]).sum())
"""


def test_a_plain_argparse_task_refusing_its_flags_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "plain_task.py").write_text(PLAIN_TASK)
    out = launch(tmp_path / "run", ["plain_task", "--n", "x"], PYTHONPATH=str(tmp_path))
    said = messages(out)
    assert out[0].rc == 2 and len(said) == 1 and "invalid int value: 'x'" in said[0], said


# --- 5. --steps changed on resume --------------------------------------------------------------------------------

EXTEND = [*CLASSIFIER, "--steps", "12", "--ckpt-every", "3", "--log-every", "1", "--warmup-steps", "2",
          "--lr", "0.01", "--no-async-save"]  # the kills below come two steps after a save: it must be committed


def lrs(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["lr"] for m in metrics(run_dir) if "lr" in m}


@pytest.mark.train
def test_extend_continues_the_schedule_from_the_saved_lr(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert launch(run, EXTEND, fault="step@8")[0].rc == -signal.SIGKILL  # checkpoint at step 6 of 12
    saved = lrs(run)[6]
    longer = [a if a != "12" else "20" for a in EXTEND]
    refused = launch(run, longer)
    said = messages(refused)
    assert refused[0].rc == 2 and len(said) == 1 and "--extend" in said[0], said
    assert not (run / "final.json").exists()
    kept = tmp_path / "kept"
    shutil.copytree(run, kept)
    out = launch(run, [*longer, "--extend"])
    assert out[0].rc == 0, terminal(out)
    assert "schedule: --steps 12 → 20 (--extend): the LR goes on from" in out[0].out
    got = lrs(run)
    assert got[6] == saved  # the record of the killed start, up to the checkpoint, stays
    low = 0.1 * 0.01
    for step in range(7, 21):  # a half cosine from the saved LR at step 6 down to min_lr_ratio × lr at step 20
        want = low + (saved - low) * 0.5 * (1 + math.cos(math.pi * (step - 6) / 14))
        assert got[step] == pytest.approx(want, rel=1e-9), step
    assert got[20] == pytest.approx(low, rel=1e-12)
    # Killed inside the extended schedule and resumed (no --extend needed now): the same run, to the bit.
    assert launch(kept, [*longer, "--extend"], fault="step@17")[0].rc == -signal.SIGKILL
    assert launch(kept, longer)[0].rc == 0
    assert lrs(kept) == got and {m["step"]: m["loss"] for m in metrics(kept)} == {
        m["step"]: m["loss"] for m in metrics(run)}


def test_the_extended_schedule_is_exact_at_both_ends() -> None:
    from trainers.checkpoint.resume import lr_lambda

    cfg = TrainConfig(steps=12, warmup_steps=2, min_lr_ratio=0.1)
    old = lr_lambda(cfg)
    new = lr_lambda(TrainConfig(steps=20, warmup_steps=2, min_lr_ratio=0.1), (6, old(6)))
    assert new(6) == old(6) and new(20) == pytest.approx(0.1, abs=1e-15) and new(25) == pytest.approx(0.1)
    assert all(new(s) > new(s + 1) for s in range(6, 20))
    assert lr_lambda(cfg)(3) == old(3)  # without an anchor: the plain plan, as before


# --- 6. task help touches nothing --------------------------------------------------------------------------------

@pytest.mark.train
@pytest.mark.parametrize("how", [["help", "trainers.tasks.lm"], ["trainers.tasks.lm", "--size", "small", "--help"]])
def test_task_help_lists_both_kinds_of_flags_and_touches_nothing(tmp_path: Path, how: list[str]) -> None:
    out = subprocess.run([sys.executable, "-m", "trainers", *how], capture_output=True, text=True, cwd=tmp_path,
                         env=clean_env(PYTHONPATH=str(REPO)), timeout=120)
    assert out.returncode == 0, out.stderr
    for flag in ("--steps", "--extend", "--keep-best", "--size", "--text", "--seq-len"):
        assert flag in out.stdout, flag
    assert "task flags (trainers.tasks.lm)" in out.stdout and not out.stderr
    assert list(tmp_path.iterdir()) == []  # no run folder, no log


@pytest.mark.train
def test_help_for_a_task_that_cannot_be_imported_is_one_line(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "trainers", "help", "no_such_task_module"], capture_output=True,
                         text=True, cwd=tmp_path, env=clean_env(PYTHONPATH=str(REPO)), timeout=120)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and "HINT" in out.stderr
    assert list(tmp_path.iterdir()) == []


# --- 6b. what a rank would refuse, said before anything runs (`hpcjobs doctor --probe` asks it on a node) -------

BROKEN_TASKS = {
    "imports_missing": "import no_such_package_for_hpcjobs_tests\n",
    "no_data": "def make_task(args):\n    raise FileNotFoundError(f'no such file: {args[1]}')\n",
    "builds_lazily": ("import torch\nfrom trainers.task import Task\n"
                      "def never(*a):\n    raise RuntimeError('built')\n"
                      "def make_task(args):\n"
                      "    return Task(name='lazy', model=never, train_data=never, loss=never)\n"),
    "no_entry_point": "x = 1\n",
}


@pytest.mark.parametrize("task,args,says", [
    ("trainers.tasks.lm", ["--size", "small", "--steps", "10"], None),
    ("trainers.tasks.lm", ["--lr", "abc"], "--lr 'abc' is not a number; valid: --lr X with X > 0"),
    ("trainers.tasks.lm", ["--size", "huge"], "trainers.tasks.lm: --size: invalid choice: 'huge'"),
    ("trainers.tasks.lm", ["--size", "tiny", "--no-such-flag"], "--no-such-flag"),
    ("imports_missing", [], "task imports_missing cannot be imported (ModuleNotFoundError: No module named "
                            "'no_such_package_for_hpcjobs_tests')"),
    ("no_data", ["--text", "corpus.txt"], "no_data failed to load (FileNotFoundError: no such file: corpus.txt)"),
    ("builds_lazily", ["--steps", "5"], None),  # its model and data are never built: make_task is all it runs
    ("no_entry_point", [], "task module 'no_entry_point' defines neither make_task(args) nor task"),
    ("trainers.tasks.lm", ["--steps", "3", "--help"], None),  # a rank shows the flags and refuses nothing
])
def test_check_task_says_what_a_rank_would_refuse(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, task: str,
                                                  args: list[str], says: str | None) -> None:
    from trainers.run import check_task

    for name, source in BROKEN_TASKS.items():
        (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    refused = check_task(task, args)
    assert refused is None if says is None else (refused is not None and says in refused and "\n" not in refused), \
        refused


def test_check_task_knows_a_size_that_needs_gpus() -> None:
    import torch

    from trainers.run import check_task

    refused = check_task("trainers.tasks.lm", ["--size", "7b"])
    assert (refused is None) == torch.cuda.is_available(), refused  # the node's own CUDA decides, not the login's


@pytest.mark.train
def test_trainers_check_is_one_line_and_an_exit_code_and_touches_nothing(tmp_path: Path) -> None:
    def check(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "trainers", "check", *args], capture_output=True, text=True,
                              cwd=tmp_path, env=clean_env(PYTHONPATH=str(REPO)), timeout=120)

    ok = check("trainers.tasks.lm", "--size", "small", "--steps", "10")
    assert (ok.returncode, ok.stdout, ok.stderr) == (0, "trainers.tasks.lm accepts --size small --steps 10\n", "")
    bad = check("trainers.tasks.lm", "--size", "huge")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and bad.stderr.startswith("hpcjobs: "), bad.stderr
    assert "'huge'" in bad.stderr and "valid: --size 1b|7b|large|medium|small|tiny" in bad.stderr
    moved = check("trainers.tasks.lm", "--run-dir", str(tmp_path / "run"), "--steps", "3")  # the launcher's flag
    assert (moved.returncode, moved.stdout) == (0, "trainers.tasks.lm accepts --steps 3\n"), moved.stderr
    usage = check()
    assert usage.returncode == 2 and "usage: python -m trainers check TASK" in usage.stderr
    assert list(tmp_path.iterdir()) == []  # no run folder, no log


# --- 7. what a person at the terminal sees -----------------------------------------------------------------------

@pytest.mark.train
def test_the_end_of_training_is_one_summary_line(tmp_path: Path) -> None:
    run = tmp_path / "run"
    out = launch(run, [*CLASSIFIER, "--steps", "6", "--log-every", "2", "--eval-every", "3"])
    assert out[0].rc == 0
    line = next(x for x in out[0].out.splitlines() if "finished at step 6" in x)
    evals = {m["step"]: m["val_loss"] for m in metrics(run) if "val_loss" in m}
    best = min(evals, key=evals.get)
    assert " in " in line and "(6 steps this start)" in line
    assert f"last loss {metrics(run)[-2]['loss']:.4f}" in line
    assert f"best val_loss {evals[best]:.4f} (step {best})" in line
    assert f"checkpoints in {run / 'checkpoints'}, metrics in {run / 'metrics.jsonl'}" in line


@pytest.mark.train
def test_a_stopped_run_says_how_to_resume(tmp_path: Path) -> None:
    run = tmp_path / "run"
    procs, out_dir = start(run, [*CLASSIFIER, "--steps", "1000000", "--log-every", "20"])
    deadline = time.time() + 120
    while not (run / "heartbeat.json").exists():
        assert time.time() < deadline and procs[0].poll() is None
        time.sleep(0.1)
    procs[0].send_signal(signal.SIGINT)
    out = finish(procs, out_dir)
    assert out[0].rc == 0, terminal(out)
    assert f"to resume, run the same command again (it continues {run};" in out[0].out


class FakeTerminal:
    was_tty = True
    terminal_hook = None

    def __init__(self) -> None:
        self.seen = io.StringIO()

    def terminal_stream(self) -> io.StringIO:
        return self.seen


def test_the_progress_bar_shows_elapsed_and_eta_and_prints_lines_above_itself() -> None:
    from trainers.progress import Bar

    fake = FakeTerminal()
    bar = Bar(fake, total=100, done=10, force_terminal=True)
    assert fake.terminal_hook == bar.write  # the Tee hands it the rank's output while it is up
    bar.write(b"[hpcjobs rank 0] step 20 | loss 1.0\n[hpcjobs rank 0] step")
    bar.update(20)
    bar.write(b" 30 | loss 0.9\n")
    bar.close()
    seen = fake.seen.getvalue()
    assert "elapsed" in seen and "ETA" in seen and "20/100" in seen
    assert "[hpcjobs rank 0] step 20 | loss 1.0" in seen and "[hpcjobs rank 0] step 30 | loss 0.9" in seen
    assert fake.terminal_hook is None


@pytest.mark.parametrize("rank,tty", [(0, True), (0, False), (1, True)])
def test_only_rank_0_started_on_a_terminal_draws_the_bar(tmp_path: Path, rank: int, tty: bool) -> None:
    from trainers.meter import Meter

    env = DistEnv(rank, rank, 2, 2, "127.0.0.1", 1, "j", 0, "torchrun")
    fake = FakeTerminal()
    fake.was_tty = tty
    task = Task(name="t", model=lambda: torch.nn.Linear(1, 1), train_data=lambda: [], loss=lambda m, b: b)
    meter = Meter(DistContext(env, torch.device("cpu"), "gloo"), TrainConfig(steps=10), task,
                  RunFolder(tmp_path), 1, 0, fake)
    assert (meter.bar is not None) == (rank == 0 and tty)
    meter.close()


@pytest.mark.train
def test_under_a_terminal_the_bar_goes_to_the_terminal_and_not_into_the_log(tmp_path: Path) -> None:
    run = tmp_path / "run"
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "trainers", *CLASSIFIER, "--steps", "400", "--log-every", "100",
                             "--run-dir", str(run)], cwd=REPO, env=clean_env(COLUMNS="120"), stdin=follower,
                            stdout=follower, stderr=follower)
    os.close(follower)
    seen = b""
    while True:
        ready, _, _ = select.select([leader], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(leader, 1 << 16)
            except OSError:  # the other end closed
                break
            if not chunk:
                break
            seen += chunk
        elif proc.poll() is not None:
            break
    assert proc.wait(timeout=120) == 0, seen.decode(errors="replace")[-2000:]
    os.close(leader)
    text = seen.decode(errors="replace")
    log = (run / "logs" / "restart-0" / "rank-0.log").read_text()
    assert "ETA" in text and "elapsed" in text and "finished at step 400" in text
    assert "ETA" not in log and "finished at step 400" in log


def test_a_text_file_is_memory_mapped_and_read_as_before(tmp_path: Path) -> None:
    """--text read the whole file as int64 on every rank, for the training and the validation set each (16 bytes of
    memory a byte of text): now every rank maps the file's bytes, and the windows are the same int64 tokens."""
    import pickle

    from trainers.tasks import lm

    text = tmp_path / "corpus.txt"
    data = bytes(range(256)) * 40
    text.write_bytes(data)
    task = lm.make_task(["--text", str(text), "--seq-len", "16"])
    train, val = task.train_data(), task.val_data()
    old = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()  # what the old path built
    cut = len(data) * 19 // 20
    assert len(train) == (cut - 1) // 16 and len(val) == (len(data) - cut - 1) // 16
    assert all(torch.equal(train[i], old[i * 16: i * 16 + 17]) for i in range(len(train)))
    assert all(torch.equal(val[i], old[cut + i * 16: cut + i * 16 + 17]) for i in range(len(val)))
    assert train[0].dtype == torch.int64 and train.tokens.dtype == torch.uint8
    maps = [line.split() for line in Path("/proc/self/maps").read_text().splitlines() if str(text) in line]
    spans = [tuple(int(x, 16) for x in m[0].split("-")) for m in maps]
    for tokens in (train.tokens, val.tokens):  # views into a mapping of the file, not a copy
        assert any(lo <= tokens.data_ptr() < hi for lo, hi in spans)
    again = pickle.loads(pickle.dumps(val))  # a spawned loader worker maps the file again
    assert again.source == val.source and torch.equal(again[3], val[3])
