"""Exact resume (CPU, gloo, 1, 2 and 4 ranks, --strategy ddp and fsdp): N steps straight vs. K steps → SIGKILL →
restart → N steps gives the same loss at every step and bit-identical final weights; also with the kill landing
inside a checkpoint write, the asynchronous one of step 9 included (its save points run in the background thread)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import REPO, hpcjobs, newest_log
from trainers import checkpoint
from trainers.checkpoint.dcp_files import model_weights

STEPS = 12
ARGS = ["trainers.tasks.lm", "--size", "tiny", "--dropout", "0.1", "--steps", str(STEPS), "--log-every", "1",
        "--ckpt-every", "3", "--batch-size", "4", "--grad-accum", "2", "--warmup-steps", "2", "--seed", "7",
        "--eval-every", "4", "--keep-best"]


def train(run_dir: Path, ranks: int, fault: str | None = None, strategy: str = "ddp", *more: str) -> int:
    env = {"HPCJOBS_FAULT_INJECT": fault} if fault else {"HPCJOBS_FAULT_INJECT": ""}
    manual = ("--max-recoveries", "0") if fault else ()  # the kill ends the run; the next command resumes it
    out = hpcjobs("submit", "--profile", "local", "--gpus", str(ranks), "--run-dir", str(run_dir), *manual, *ARGS,
                  "--strategy", strategy, *more, cwd=REPO, env=env, timeout=300)
    return out.returncode


def losses(run_dir: Path) -> dict[tuple[int, str], float]:
    """The last logged loss and val_loss of each step (a killed run logged some steps that the resumed run redid).
    Evaluating must change nothing a resumed run has to reproduce, so the val_loss values must match too."""
    out: dict[tuple[int, str], float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        kind = "val_loss" if "val_loss" in rec else "loss"
        out[(rec["step"], kind)] = rec[kind]
    return out


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    ref = checkpoint.latest(run_dir / "checkpoints")
    assert ref is not None and ref.step == STEPS
    return model_weights(ref)


def assert_same_run(expected: Path, run: Path) -> None:
    """The same loss and val_loss floats at every step, and bit-identical final weights."""
    assert losses(run) == losses(expected)
    a, b = final_weights(expected), final_weights(run)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class Straight:
    """Uninterrupted runs, made when a test first asks for one (a -k selection runs only the ones it needs)."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self.factory, self.runs = factory, {}

    def __call__(self, ranks: int, strategy: str = "ddp") -> Path:
        if (ranks, strategy) not in self.runs:
            run = self.factory.mktemp(f"straight-{strategy}{ranks}") / "run"
            assert train(run, ranks, strategy=strategy) == 0
            self.runs[ranks, strategy] = run
        return self.runs[ranks, strategy]


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Straight:
    return Straight(tmp_path_factory)


SAVE_FAULTS = ("save-written@9", "save-marked@9", "save-renamed@9:0")
CASES = [("ddp", 1, "step@7"), ("ddp", 1, "save-written@9"), *[("ddp", 2, f) for f in ("step@7", *SAVE_FAULTS)],
    ("ddp", 4, "step@7"),  # gloo's ring sums in an order that depends on DDP's bucket grouping (settle_ddp_buckets)
    ("ddp", 4, "save-shards@9:2"),
    ("fsdp", 1, "step@7"), ("fsdp", 1, "save-shards@9"),
    *[("fsdp", 2, f) for f in ("step@7", *SAVE_FAULTS)],
    ("fsdp", 4, "step@7"), ("fsdp", 4, "save-shards@9:3"),
]


@pytest.mark.train
@pytest.mark.parametrize("strategy,ranks,fault", CASES)
def test_kill_and_resume_is_exact(strategy: str, ranks: int, fault: str, straight: Straight, tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert train(run, ranks, fault, strategy) != 0, "the injected SIGKILL should have ended the first attempt"
    # The kill inside step 9's background save may land after step 12 was logged (the final save waits for the one
    # in flight), so what the first attempt must not have reached is the final checkpoint, not the last step.
    first = checkpoint.latest(run / "checkpoints")
    assert first is not None and first.step < STEPS
    if fault.startswith(("save-shards", "save-written")):  # the kill came inside the (background) save of step 9
        assert (run / "checkpoints" / ".step-9.tmp").is_dir() and checkpoint.latest(run / "checkpoints").step < 9
    assert train(run, ranks, strategy=strategy) == 0
    log = newest_log(run)
    assert "resumed from" in log and f"{ranks} rank(s), {strategy}," in log
    assert_same_run(straight(ranks, strategy), run)


@pytest.mark.train
def test_fp16_under_fsdp_resumes_exactly_with_its_loss_scale(tmp_path: Path) -> None:
    """fp16 under fsdp: FSDP2 casts the parameters to fp16, and a ShardedGradScaler's state goes on from the
    checkpoint. Whether a gradient overflows fp16 at this learning rate depends on the CPU's fp16 kernels (one
    overflowed before step 3 on a VM without AVX512-FP16, none did in 12 steps on one with it), so the test rests on
    what holds on both: the scaler's growth tracker counts the steps since its last overflow, and in the
    uninterrupted run it reaches back past step 6, where the killed run resumes; a resume that restarted the scaler
    would end with a smaller count (and, where an overflow came first, a larger scale)."""
    # Saves in the foreground: step 6's save is committed before step 7 starts, so the kill at step 7 leaves step 6
    # as the newest checkpoint. A background save of step 6 could still be in flight then (CI saw a resume from
    # step 4), and the tracker's bound below is counted from step 6.
    fp16 = ("--precision", "fp16", "--lr", "0.3", "--no-async-save")
    straight, run = tmp_path / "straight", tmp_path / "run"
    assert train(straight, 2, None, "fsdp", *fp16) == 0
    assert train(run, 2, "step@7", "fsdp", *fp16) != 0  # its newest finished checkpoint: step 6 (--ckpt-every 3)
    assert train(run, 2, None, "fsdp", *fp16) == 0
    log = newest_log(run)
    assert "resumed from" in log and "step-6" in log and "precision fp16" in log, log
    scalers = {}
    for name, folder in (("straight", straight), ("resumed", run)):
        last = checkpoint.latest(folder / "checkpoints")
        assert last is not None and last.step == STEPS
        scalers[name] = checkpoint.read_states(last, 0, shared_keys=("scaler",), own=False)[0]["scaler"]
    assert scalers["straight"]["_growth_tracker"] > STEPS - 6, scalers  # counts from before the resume point
    assert scalers["resumed"] == scalers["straight"], scalers
    assert_same_run(straight, run)


@pytest.mark.train
def test_different_world_size_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert train(run, 2, "step@5") != 0
    out = hpcjobs("submit", "--profile", "local", "--gpus", "1", "--run-dir", str(run), *ARGS, cwd=REPO)
    assert out.returncode == 2  # at submit, from the checkpoint's meta.json (the ranks refuse it the same way)
    assert "was written by 2 ranks with --strategy ddp, this submission has 1 with --strategy ddp" in out.stderr
    assert "add --reshard" in out.stderr


@pytest.mark.train
def test_different_settings_are_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert train(run, 1, "step@5") != 0  # after step 4's --keep-best save, made in the foreground
    args = [a if a != "0.1" else "0.2" for a in ARGS]  # another dropout: another task config
    out = hpcjobs("submit", "--profile", "local", "--gpus", "1", "--run-dir", str(run), *args, cwd=REPO)
    assert out.returncode != 0
    log = "".join(p.read_text() for p in (run / "logs").rglob("rank-0.log"))
    assert "was written with other settings" in log and "dropout" in log


@pytest.mark.train
def test_random_augmentation_in_workers_resumes_exactly_whatever_the_worker_count(tmp_path: Path) -> None:
    """Noise drawn in loader workers: each sample is seeded from (seed, epoch, index), so a resume in the middle of
    an epoch (the workers start afresh) and another worker count both give the same weights. Workers seeded once
    per loader would draw the resumed samples' noise from the start of their streams."""
    args = ["trainers.tasks.classifier", "--noise", "0.5", "--samples", "256", "--batch-size", "16", "--steps", "12",
            "--ckpt-every", "3", "--log-every", "1", "--no-async-save"]  # step 3's save is committed by step 5

    def run(name: str, workers: int, fault: str = "") -> tuple[int, Path]:
        out = hpcjobs("submit", "--profile", "local", "--gpus", "2", "--run-dir", str(tmp_path / name), *args,
                      "--num-workers", str(workers), cwd=REPO, env={"HPCJOBS_FAULT_INJECT": fault}, timeout=300)
        return out.returncode, tmp_path / name

    code, straight = run("straight", 2)
    assert code == 0
    assert run("killed", 2, "step@5")[0] != 0  # 8 steps per epoch: the resume starts at micro-batch 3 of epoch 0
    code, killed = run("killed", 2)
    assert code == 0 and "resumed from" in newest_log(killed)
    code, one_worker = run("one-worker", 1)
    assert code == 0
    a, b, c = (model_weights(checkpoint.latest(r / "checkpoints"))  # type: ignore[arg-type]
               for r in (straight, killed, one_worker))
    assert all(torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]) for k in a)


@pytest.mark.train
def test_a_short_random_kill_campaign(tmp_path: Path) -> None:
    """bench/kill_campaign.py's short version: three SIGKILLs of launcher and ranks at random moments past
    start-up (a step, a save, between a save's files); each restart resumes from the newest checkpoint finished
    before its kill, and the final weights are bit-identical to an uninterrupted run. The 100-kill campaign's
    results are in bench/results/kill_campaign.json."""
    import sys

    sys.path.insert(0, str(REPO / "bench"))
    from kill_campaign import campaign

    result = campaign(tmp_path, kills=3, seed=7)
    assert result["bit_identical"] and result["kills"] >= 2, result


@pytest.mark.train
def test_a_memory_mapped_text_file_resumes_exactly(tmp_path: Path) -> None:
    """--text maps the file (trainers.tasks.lm.text_tokens) instead of reading it whole as int64: a kill and a
    resume still give the uninterrupted run's losses and weights."""
    text = tmp_path / "corpus.txt"
    text.write_bytes(bytes(range(32, 127)) * 400)  # 38,000 bytes: 563 training windows of 65, 29 for validation
    straight, run = tmp_path / "straight", tmp_path / "run"
    assert train(straight, 1, None, "ddp", "--text", str(text)) == 0
    assert train(run, 1, "step@7", "ddp", "--text", str(text)) != 0
    assert train(run, 1, None, "ddp", "--text", str(text)) == 0
    assert "resumed from" in newest_log(run)
    assert_same_run(straight, run)
