"""An unchanged Lightning script (tests/scripts/lightning_script.py) on the real cluster, 2 nodes × 1 rank, stopped
by Slurm: it saves at the batch the ranks agree on, requeues once, resumes there mid-epoch, and ends with the losses
of an uninterrupted run step by step and bit-identical weights; the code after fit() runs once. Lightning's own
SLURMEnvironment would requeue by itself on SIGUSR1: hpcjobs turned it off, so the job is requeued once.
All three triggers passed on the test cluster; CI runs the partition-priority preemption, the other two run with
-m slow."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from script_stops import rank0_losses, stopped_and_resumed, twin_of
from test_lightning import losses as loss_lines

from conftest import REPO, hpcjobs
from trainers.integrations import lightning

pytestmark = pytest.mark.cluster
SCRIPT = REPO / "tests" / "scripts" / "lightning_script.py"
EPOCHS = 12  # 10 batches an epoch at 2 ranks: 120 steps
SAMPLE_S = "0.03"  # 4 samples a step: ~0.12 s a step, ~15 s of training, so a signal lands mid-run


def submit(folder: Path, name: str, profile: Path, time_limit: str = "30:00") -> tuple[str, Path, Path]:
    out, run = folder / f"pl-{name}", folder / f"pl-run-{name}"
    res = hpcjobs("submit", "--profile", str(profile), "--nodes", "2", "--gpus", "1", "--time", time_limit,
                  "--run-dir", str(run), "--json", str(SCRIPT), "--out", str(out), "--max_epochs", str(EPOCHS),
                  "--devices", "1", "--num_nodes", "2", "--sample_seconds", SAMPLE_S, cwd=REPO)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)["job_id"], out, run


@pytest.fixture(scope="module")
def twin(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return twin_of("pl", tmp_path_factory, submit)


@pytest.mark.parametrize("trigger", ["preemption", pytest.param("scancel-signal", marks=pytest.mark.slow),
                                     pytest.param("time-limit", marks=pytest.mark.slow)])
def test_unchanged_lightning_script_stops_requeues_and_resumes_exactly(trigger: str, twin: tuple[Path, Path]) -> None:
    out, run, stops, first = stopped_and_resumed(twin[0].parent, trigger, submit, "LOSS ")
    root = run / "checkpoints" / lightning.FOLDER
    assert f"resuming from {root / ('checkpoint-' + str(stops[0]['step']))}" in first, first[-2000:]
    assert (out / "after-fit.txt").read_text() == "ran\n"
    assert rank0_losses(run, loss_lines) == rank0_losses(twin[1], loss_lines)
    mine, theirs = torch.load(out / "final.pt"), torch.load(twin[0] / "final.pt")
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
