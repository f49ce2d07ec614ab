"""An unchanged Hugging Face Trainer script (tests/scripts/hf_trainer_script.py) on the real cluster, 2 nodes × 1
rank, stopped by Slurm: it saves at the step the ranks agree on, requeues once, resumes at that step, and ends with
the losses of an uninterrupted run step by step and bit-identical weights; the code after train() runs once.
CI runs a real partition-priority preemption; `scancel --signal=USR2` and the 2-minute time limit run with -m slow."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from script_stops import stopped_and_resumed, twin_of

from conftest import REPO, hpcjobs

pytestmark = pytest.mark.cluster
SCRIPT = REPO / "tests" / "scripts" / "hf_trainer_script.py"
STEPS = 120
SAMPLE_S = "0.03"  # 4 samples a step: ~0.12 s a step, ~15 s of training, so a signal lands mid-run


def submit(folder: Path, name: str, profile: Path, time_limit: str = "30:00") -> tuple[str, Path, Path]:
    out, run = folder / f"hf-{name}", folder / f"hf-run-{name}"
    # The time limit's signal comes 0-30 s into each start: ~36 s of training (the sleep changes no number) outlasts
    # it, so a start either stops before its first step (and requeues) or mid-run, never ends first (seen: 15 s did).
    sample_s = "0.075" if name == "time-limit" else SAMPLE_S
    res = hpcjobs("submit", "--profile", str(profile), "--nodes", "2", "--gpus", "1", "--time", time_limit,
                  "--run-dir", str(run), "--json", str(SCRIPT), "--output_dir", str(out), "--max_steps", str(STEPS),
                  "--save_steps", "50", "--sample_seconds", sample_s, cwd=REPO)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)["job_id"], out, run


def losses(out: Path) -> list[tuple[int, float]]:
    state = json.loads((out / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    return [(h["step"], h["loss"]) for h in state["log_history"] if "loss" in h]


@pytest.fixture(scope="module")
def twin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return twin_of("hf", tmp_path_factory, submit)[0]


@pytest.mark.parametrize("trigger", ["preemption", pytest.param("scancel-signal", marks=pytest.mark.slow),
                                     pytest.param("time-limit", marks=pytest.mark.slow)])
def test_unchanged_trainer_script_stops_requeues_and_resumes_exactly(trigger: str, twin: Path) -> None:
    out, run, stops, first = stopped_and_resumed(twin.parent, trigger, submit, "'epoch'")
    assert f"resuming from {out / ('checkpoint-' + str(stops[0]['step']))}" in first, first[-2000:]
    assert (out / "after-train.txt").read_text() == "ran\n"
    assert losses(out) == losses(twin)
    mine, theirs = load_file(out / "final" / "model.safetensors"), load_file(twin / "final" / "model.safetensors")
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
