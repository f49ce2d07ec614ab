"""Exact resume (CPU, gloo, 1 and 2 ranks): N steps straight vs. K steps → SIGKILL → restart → N steps gives the
same loss at every step and bit-identical final weights; also with the kill landing inside a checkpoint write."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import REPO, hpcjobs
from trainers import checkpoint

STEPS = 12
ARGS = ["trainers.tasks.lm", "--size", "tiny", "--dropout", "0.1", "--steps", str(STEPS), "--log-every", "1",
        "--ckpt-every", "3", "--batch-size", "4", "--grad-accum", "2", "--warmup-steps", "2", "--seed", "7",
        "--eval-every", "4", "--keep-best"]


def train(run_dir: Path, ranks: int, fault: str | None = None) -> int:
    env = {"HPCJOBS_FAULT_INJECT": fault} if fault else {"HPCJOBS_FAULT_INJECT": ""}
    out = hpcjobs("submit", "--profile", "local", "--gpus", str(ranks), "--run-dir", str(run_dir), *ARGS,
                  cwd=REPO, env=env, timeout=300)
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
    return checkpoint.load_checkpoint(ref, 0)[0]["model"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    runs = {}
    for ranks in (1, 2, 4):
        run = tmp_path_factory.mktemp(f"straight{ranks}") / "run"
        assert train(run, ranks) == 0
        runs[ranks] = run
    return runs


CASES = [(r, f) for r in (1, 2) for f in ("step@7", "save-written@9", "save-marked@9", "save-renamed@9:0")]


# 4 ranks: gloo's ring sums in an order that depends on DDP's bucket grouping (see settle_ddp_buckets).
@pytest.mark.parametrize("ranks,fault", [*CASES, (4, "step@7")])
def test_kill_and_resume_is_exact(ranks: int, fault: str, straight: dict[int, Path], tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert train(run, ranks, fault) != 0, "the injected SIGKILL should have ended the first attempt"
    killed_at = losses(run)
    assert max(step for step, _ in killed_at) < STEPS
    assert train(run, ranks) == 0
    log = (run / "logs" / "restart-0" / "rank-0.log").read_text()
    assert "resumed from" in log
    expected, got = losses(straight[ranks]), losses(run)
    assert got == expected  # identical floats at every step
    a, b = final_weights(straight[ranks]), final_weights(run)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_different_world_size_is_refused(straight: dict[int, Path], tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert train(run, 2, "step@5") != 0
    out = hpcjobs("submit", "--profile", "local", "--gpus", "1", "--run-dir", str(run), *ARGS, cwd=REPO)
    assert out.returncode != 0
    log = "".join(p.read_text() for p in (run / "logs").rglob("rank-0.log"))
    assert "was written by 2 ranks, this run has 1" in log


def test_different_settings_are_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert train(run, 1, "step@4") != 0
    args = [a if a != "0.1" else "0.2" for a in ARGS]  # another dropout: another task config
    out = hpcjobs("submit", "--profile", "local", "--gpus", "1", "--run-dir", str(run), *args, cwd=REPO)
    assert out.returncode != 0
    log = "".join(p.read_text() for p in (run / "logs").rglob("rank-0.log"))
    assert "was written with other settings" in log and "dropout" in log


def test_random_augmentation_in_workers_resumes_exactly_whatever_the_worker_count(tmp_path: Path) -> None:
    """Noise drawn in loader workers: each sample is seeded from (seed, epoch, index), so a resume in the middle of
    an epoch (the workers start afresh) and another worker count both give the same weights. Workers seeded once
    per loader would draw the resumed samples' noise from the start of their streams."""
    args = ["trainers.tasks.classifier", "--noise", "0.5", "--samples", "256", "--batch-size", "16", "--steps", "12",
            "--ckpt-every", "3", "--log-every", "1"]

    def run(name: str, workers: int, fault: str = "") -> tuple[int, Path]:
        out = hpcjobs("submit", "--profile", "local", "--gpus", "2", "--run-dir", str(tmp_path / name), *args,
                      "--num-workers", str(workers), cwd=REPO, env={"HPCJOBS_FAULT_INJECT": fault}, timeout=300)
        return out.returncode, tmp_path / name

    code, straight = run("straight", 2)
    assert code == 0
    assert run("killed", 2, "step@5")[0] != 0  # 8 steps per epoch: the resume starts at micro-batch 3 of epoch 0
    code, killed = run("killed", 2)
    assert code == 0 and "resumed from" in (killed / "logs" / "restart-0" / "rank-0.log").read_text()
    code, one_worker = run("one-worker", 1)
    assert code == 0
    a, b, c = (checkpoint.load_checkpoint(checkpoint.latest(r / "checkpoints"), 0)[0]["model"]  # type: ignore[arg-type]
               for r in (straight, killed, one_worker))
    assert all(torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]) for k in a)


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
