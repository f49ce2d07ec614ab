"""An unchanged Hugging Face Trainer script (tests/scripts/hf_trainer_script.py) on the real cluster, 2 nodes × 1
rank and 2 nodes × 2 ranks, stopped by Slurm: it saves at the step the ranks agree on, requeues once, resumes at that
step, and ends with the losses of an uninterrupted run step by step and bit-identical weights; the code after train()
runs once. At 2 × 2 (issue 42) DDP rebuilds its buckets (`ddp_find_unused_parameters` false, the Trainer's own choice
under activation checkpointing; AdamW and the linear schedule step every step) and the order of the gradient
all-reduce's additions follows its bucket layout (trainers/ddp_buckets.py); a twin with another seed is the control.
CI runs a real partition-priority preemption at 2 × 2; the 2 × 1 cases run with -m slow."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from script_stops import Submit, stopped_and_resumed, twin_of, twins_with_a_control

from conftest import REPO, hpcjobs

pytestmark = pytest.mark.cluster
SCRIPT = REPO / "tests" / "scripts" / "hf_trainer_script.py"
STEPS = 120
SAMPLE_S = "0.03"  # 4 samples a step: ~0.12 s a step, ~15 s of training, so a signal lands mid-run


def submit(folder: Path, name: str, profile: Path, time_limit: str = "30:00", per_node: int = 1,
           seed: int = 0) -> tuple[str, Path, Path]:
    out, run = folder / f"hf-{name}-{per_node}x-seed{seed}", folder / f"hf-run-{name}-{per_node}x-seed{seed}"
    # The time limit's signal comes 0-30 s into each start: ~36 s of training (the sleep changes no number) outlasts
    # it, so a start either stops before its first step (and requeues) or mid-run, never ends first (seen: 15 s did).
    sample_s = "0.075" if name == "time-limit" else SAMPLE_S
    rebuilt = ["--ddp_find_unused_parameters", "false"] if per_node == 2 else []
    res = hpcjobs("submit", "--profile", str(profile), "--nodes", "2", "--gpus", str(per_node), "--time", time_limit,
                  "--run-dir", str(run), "--json", str(SCRIPT), "--output_dir", str(out), "--max_steps", str(STEPS),
                  "--save_steps", "50", "--sample_seconds", sample_s, "--seed", str(seed), *rebuilt, cwd=REPO)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)["job_id"], out, run


def losses(out: Path) -> list[tuple[int, float]]:
    state = json.loads((out / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    return [(h["step"], h["loss"]) for h in state["log_history"] if "loss" in h]


@pytest.fixture(scope="module")
def twin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return twin_of("hf", tmp_path_factory, submit)[0]


@pytest.fixture(scope="module")
def twins4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """At 2 × 2: the uninterrupted run's output folder, and the output folder of its twin with another seed."""
    (twin, _), control = twins_with_a_control("hf4", tmp_path_factory, functools.partial(submit, per_node=2))
    return twin, twin.parent / control.name.replace("hf-run-", "hf-")


@pytest.mark.parametrize("trigger", [pytest.param("preemption", marks=pytest.mark.slow),
                                     pytest.param("scancel-signal", marks=pytest.mark.slow),
                                     pytest.param("time-limit", marks=pytest.mark.slow)])
def test_unchanged_trainer_script_stops_requeues_and_resumes_exactly(trigger: str, twin: Path) -> None:
    exactly_as_its_twin(trigger, twin, submit)


def test_at_2_nodes_x_2_ranks_a_preempted_trainer_script_resumes_exactly(twins4: tuple[Path, Path]) -> None:
    out = exactly_as_its_twin("preemption", twins4[0], functools.partial(submit, per_node=2))
    assert losses(out) != losses(twins4[1])  # the control: another seed differs


def exactly_as_its_twin(trigger: str, twin: Path, submit: Submit) -> Path:
    out, run, stops, first = stopped_and_resumed(twin.parent, trigger, submit, "'epoch'")
    assert f"resuming from {out / ('checkpoint-' + str(stops[0]['step']))}" in first, first[-2000:]
    assert (out / "after-train.txt").read_text() == "ran\n"
    assert losses(out) == losses(twin)
    mine, theirs = load_file(out / "final" / "model.safetensors"), load_file(twin / "final" / "model.safetensors")
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    return out
