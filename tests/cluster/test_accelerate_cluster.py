"""An accelerate loop with hpcjobs's one line (tests/scripts/accelerate_script.py) on the real cluster, 2 nodes × 1
rank, stopped by Slurm: it saves at the step the ranks agree on, requeues once, resumes there mid-epoch, and ends
with the losses of an uninterrupted run step by step and bit-identical weights; the code after the loop runs once.
CI runs the partition-priority preemption; the scancel signal and the 2-minute time limit run with -m slow.
Written on the local profile's evidence (tests/test_accelerate_loop.py); not yet run on the test cluster."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from script_stops import rank0_losses, stopped_and_resumed, twin_of
from test_accelerate_loop import losses as loss_lines

from conftest import REPO, hpcjobs
from trainers.integrations import accelerate_loop

pytestmark = pytest.mark.cluster
SCRIPT = REPO / "trainers" / "examples" / "accelerate_script.py"
EPOCHS = 12  # 10 batches an epoch at 2 ranks: 120 steps
SAMPLE_S = "0.03"  # 4 samples a step: ~0.12 s a step, ~15 s of training, so a signal lands mid-run


def submit(folder: Path, name: str, profile: Path, time_limit: str = "30:00") -> tuple[str, Path, Path]:
    out, run = folder / f"acc-{name}", folder / f"acc-run-{name}"
    res = hpcjobs("submit", "--profile", str(profile), "--nodes", "2", "--gpus", "1", "--time", time_limit,
                  "--run-dir", str(run), "--json", str(SCRIPT), "--out", str(out), "--epochs", str(EPOCHS),
                  "--sample_seconds", SAMPLE_S, cwd=REPO)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)["job_id"], out, run


@pytest.fixture(scope="module")
def twin(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return twin_of("acc", tmp_path_factory, submit)


@pytest.mark.parametrize("trigger", ["preemption", pytest.param("scancel-signal", marks=pytest.mark.slow),
                                     pytest.param("time-limit", marks=pytest.mark.slow)])
def test_accelerate_loop_stops_requeues_and_resumes_exactly(trigger: str, twin: tuple[Path, Path]) -> None:
    out, run, stops, first = stopped_and_resumed(twin[0].parent, trigger, submit, "LOSS ")
    root = run / "checkpoints" / accelerate_loop.FOLDER
    assert f"resuming from {root / ('checkpoint-' + str(stops[0]['step']))}" in first, first[-2000:]
    assert (out / "after-loop.txt").read_text() == "ran\n"
    assert rank0_losses(run, loss_lines) == rank0_losses(twin[1], loss_lines)
    mine, theirs = torch.load(out / "final.pt"), torch.load(twin[0] / "final.pt")
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
