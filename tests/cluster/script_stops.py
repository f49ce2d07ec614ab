"""An unchanged user's script (Hugging Face Trainer, Lightning, an accelerate loop) on the test cluster, stopped by
Slurm and resumed: the twin it is compared with and the stop itself, shared by tests/cluster/test_hf_trainer_cluster.py,
test_lightning_cluster.py and test_accelerate_cluster.py, each with its own `submit` and its own loss records."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_preemption import DONE, make_profile, trigger_now, wait_for_log

from conftest import wait_for_state

Submit = Callable[..., tuple[str, Path, Path]]
"""submit(folder, name, profile, time_limit=...) -> (job id, the script's output folder, the run folder)."""


def shared_folder(prefix: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of /tmp the nodes see, one per test session and prefix."""
    folder = Path("/tmp") / f"hpcjobs-{prefix}-{tmp_path_factory.getbasetemp().name}"
    folder.mkdir(exist_ok=True)
    folder.chmod(0o755)
    return folder


def twin_of(prefix: str, tmp_path_factory: pytest.TempPathFactory, submit: Submit) -> tuple[Path, Path]:
    """The uninterrupted run: its output and run folders, in a folder of /tmp the nodes see."""
    folder = shared_folder(prefix, tmp_path_factory)
    job, out, run = submit(folder, "twin", make_profile(folder))
    assert wait_for_state(job, DONE, timeout=600) == "COMPLETED"
    return out, run


def twins_with_a_control(prefix: str, tmp_path_factory: pytest.TempPathFactory, submit: Submit,
                         ) -> tuple[tuple[Path, Path], Path]:
    """The uninterrupted run (output and run folders) and, run beside it, the run folder of the same command with
    another seed: the control that a comparison with the twin must tell apart from it."""
    folder = shared_folder(prefix, tmp_path_factory)
    job, _, control = submit(folder, "control", make_profile(folder), seed=1)
    twin = twin_of(prefix, tmp_path_factory, submit)
    assert wait_for_state(job, DONE, timeout=600) == "COMPLETED"
    return twin, control


def stopped_and_resumed(folder: Path, trigger: str, submit: Submit, training: str,
                        ) -> tuple[Path, Path, list[dict[str, Any]], str]:
    """The script stopped by `trigger` once rank 0 logged `training` (or by a 2-minute time limit, once a start),
    then COMPLETED; its output and run folders, its stop lines, and the resumed start's rank-0 log."""
    if trigger == "time-limit":  # the signal comes 0-30 s into each start (see test_preemption)
        profile = make_profile(folder, seconds_before=90, max_restarts=30)
        job, out, run = submit(folder, trigger, profile, time_limit="2:00")
    else:
        job, out, run = submit(folder, trigger, make_profile(folder))
        wait_for_log(run / "logs" / "restart-0" / "rank-0.log", training, timeout=300)  # training, not starting
        trigger_now(trigger, job)
    assert wait_for_state(job, DONE, timeout=900) == "COMPLETED"
    stops = [json.loads(ln) for ln in (run / "restarts.jsonl").read_text().splitlines() if "stopped" in ln]
    assert stops and (len(stops) == 1 or trigger == "time-limit"), stops
    # A time limit's signal can land before a start's first step (step -1: nothing to save, the job requeues and
    # tries again; seen once with the HF script's 29 s start-up): the stop that counts is the first that saved.
    saved = [s for s in stops if s["step"] > 0]
    assert saved, stops
    resumed = run / "logs" / f"restart-{saved[0]['restart'] + 1}" / "rank-0.log"
    return out, run, saved, resumed.read_text()


def rank0_losses(run: Path, loss_lines: Callable[[str], dict[int, str]]) -> dict[int, str]:
    """Rank 0's loss lines of every start, the later start's where two logged a step."""
    found: dict[int, str] = {}
    for log in sorted((run / "logs").glob("restart-*/rank-0.log"), key=lambda p: int(p.parent.name[8:])):
        found.update(loss_lines(log.read_text()))
    return found
