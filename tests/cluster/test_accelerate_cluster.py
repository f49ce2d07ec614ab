"""An accelerate loop with hpcjobs's one line (trainers/examples/accelerate_script.py) on the real cluster, 2 nodes ×
1 rank and 2 nodes × 2 ranks, stopped by Slurm: it saves at the step the ranks agree on, requeues once, resumes there
mid-epoch, and ends with the losses of an uninterrupted run step by step and bit-identical weights; the code after
the loop runs once. At 2 × 2 (issue 42) the loop uses AdamW and a cosine LR stepped every step, and the order of the
gradient all-reduce's additions follows DDP's bucket layout (trainers/ddp_buckets.py); a twin with another seed is
the control. CI runs the partition-priority preemption at 2 × 2; the 2 × 1 cases run with -m slow."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from script_stops import Submit, rank0_losses, stopped_and_resumed, twin_of, twins_with_a_control
from test_accelerate_loop import losses as loss_lines

from conftest import REPO, hpcjobs
from trainers.integrations import accelerate_loop

pytestmark = pytest.mark.cluster
SCRIPT = REPO / "trainers" / "examples" / "accelerate_script.py"
EPOCHS = 12  # 10 batches an epoch at 2 ranks: 120 steps
SAMPLE_S = "0.03"  # 4 samples a step: ~0.12 s a step, ~15 s of training, so a signal lands mid-run


FOUR = ["--samples", "160", "--adamw"]
"""2 nodes × 2 ranks: 10 batches a rank and epoch again; AdamW and a cosine LR stepped every step."""


def submit(folder: Path, name: str, profile: Path, time_limit: str = "30:00", per_node: int = 1,
           seed: int = 0) -> tuple[str, Path, Path]:
    name = f"{name}-{per_node}x-seed{seed}"
    out, run = folder / f"acc-{name}", folder / f"acc-run-{name}"
    res = hpcjobs("submit", "--profile", str(profile), "--nodes", "2", "--gpus", str(per_node), "--time", time_limit,
                  "--run-dir", str(run), "--json", str(SCRIPT), "--out", str(out), "--epochs", str(EPOCHS),
                  "--sample_seconds", SAMPLE_S, "--seed", str(seed), *(FOUR if per_node == 2 else []), cwd=REPO)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)["job_id"], out, run


@pytest.fixture(scope="module")
def twin(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return twin_of("acc", tmp_path_factory, submit)


@pytest.fixture(scope="module")
def twins4(tmp_path_factory: pytest.TempPathFactory) -> tuple[tuple[Path, Path], Path]:
    """At 2 × 2: the uninterrupted run, and the run folder of its twin with another seed (run at the same time)."""
    return twins_with_a_control("acc4", tmp_path_factory, functools.partial(submit, per_node=2))


@pytest.mark.parametrize("trigger", [pytest.param("preemption", marks=pytest.mark.slow),
                                     pytest.param("scancel-signal", marks=pytest.mark.slow),
                                     pytest.param("time-limit", marks=pytest.mark.slow)])
def test_accelerate_loop_stops_requeues_and_resumes_exactly(trigger: str, twin: tuple[Path, Path]) -> None:
    exactly_as_its_twin(trigger, twin, submit)


def test_at_2_nodes_x_2_ranks_a_preempted_accelerate_loop_resumes_exactly(
        twins4: tuple[tuple[Path, Path], Path]) -> None:
    run = exactly_as_its_twin("preemption", twins4[0], functools.partial(submit, per_node=2))
    assert rank0_losses(run, loss_lines) != rank0_losses(twins4[1], loss_lines)  # the control: another seed differs


def exactly_as_its_twin(trigger: str, twin: tuple[Path, Path], submit: Submit) -> Path:
    out, run, stops, first = stopped_and_resumed(twin[0].parent, trigger, submit, "LOSS ")
    root = run / "checkpoints" / accelerate_loop.FOLDER
    assert f"resuming from {root / ('checkpoint-' + str(stops[0]['step']))}" in first, first[-2000:]
    assert (out / "after-loop.txt").read_text() == "ran\n"
    assert rank0_losses(run, loss_lines) == rank0_losses(twin[1], loss_lines)
    mine, theirs = torch.load(out / "final.pt"), torch.load(twin[0] / "final.pt")
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    return run
