"""An unchanged Hugging Face Trainer script under hpcjobs (trainers/integrations/hf_trainer.py), 2 local ranks on
gloo: one Ctrl-C saves at the step all ranks agree on and exits before the code after train(); the same command
resumes at that step and finishes; the losses step by step and the final weights equal an uninterrupted run's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import BIN, REPO, hpcjobs
from trainers.integrations import hf_trainer

SCRIPT = REPO / "tests" / "scripts" / "hf_trainer_script.py"
STEPS = 30


def command(tmp_path: Path, name: str) -> list[str]:
    return ["submit", "--profile", "local", "--gpus", "2", "--run-dir", str(tmp_path / f"run-{name}"), str(SCRIPT),
            "--output_dir", str(tmp_path / name), "--max_steps", str(STEPS)]


def losses(out: Path) -> list[tuple[int, float]]:
    state = json.loads((out / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    return [(h["step"], h["loss"]) for h in state["log_history"] if "loss" in h]


def test_ctrl_c_saves_at_the_agreed_step_and_the_same_command_resumes_exactly(tmp_path: Path) -> None:
    twin = hpcjobs(*command(tmp_path, "twin"), cwd=tmp_path, timeout=600)
    assert twin.returncode == 0 and "AFTER TRAIN" in twin.stdout, twin.stdout[-3000:] + twin.stderr[-3000:]

    proc = subprocess.Popen([str(BIN / "hpcjobs"), *command(tmp_path, "out")], cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=os.environ.copy())
    assert proc.stdout is not None
    seen, deadline = [], time.time() + 300
    while len([line for line in seen if "'loss'" in line]) < 7:
        line = proc.stdout.readline()
        assert line and time.time() < deadline, "".join(seen)[-3000:]
        seen.append(line)
    proc.send_signal(signal.SIGINT)  # one Ctrl-C, as a terminal sends it to the foreground command
    rest, _ = proc.communicate(timeout=300)
    first = "".join(seen) + rest
    out = tmp_path / "out"
    done = [n for n, p in hf_trainer.checkpoints(out) if (p / hf_trainer.COMPLETE).is_file()]
    assert done and 7 <= done[-1] < STEPS, first[-3000:]
    stop = done[-1]
    assert "AFTER TRAIN" not in first and not (out / "after-train.txt").exists()  # nothing after train() on a stop
    assert not (out / f"checkpoint-{stop}" / hf_trainer.PENDING).exists()

    again = hpcjobs(*command(tmp_path, "out"), cwd=tmp_path, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"resuming from {out / f'checkpoint-{stop}'}" in again.stdout
    resumed = [json.loads(line.replace("'", '"')) for line in again.stdout.splitlines() if line.startswith("{'loss'")]
    assert len(resumed) == STEPS - stop  # the second start trained only the steps after the stop
    assert (out / "after-train.txt").read_text() == "ran\n"  # once, after the training that finished

    assert losses(out) == losses(tmp_path / "twin")
    mine, theirs = load_file(out / "final" / "model.safetensors"), load_file(tmp_path / "twin" / "final" /
                                                                              "model.safetensors")
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_an_incomplete_checkpoint_is_moved_aside_and_the_one_before_is_resumed(tmp_path: Path,
                                                                               capsys: pytest.CaptureFixture[str]) \
        -> None:
    """A save killed halfway leaves its pending mark and no completion mark: never resumed, moved aside, also
    when the script's own get_last_checkpoint hands it to train()."""
    out = tmp_path / "out"
    for step, marks in ((10, [hf_trainer.COMPLETE]), (20, [hf_trainer.PENDING]), (5, [])):
        folder = out / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        for mark in marks:
            (folder / mark).write_text("{}")
    assert hf_trainer.resume_point(str(out), str(out / "checkpoint-20")) == str(out / "checkpoint-10")
    assert (out / hf_trainer.ASIDE / "checkpoint-20").is_dir() and not (out / "checkpoint-20").exists()
    assert "left incomplete" in capsys.readouterr().out
    assert hf_trainer.resume_point(str(out), None) == str(out / "checkpoint-10")
    assert hf_trainer.resume_point(str(out), str(out / "checkpoint-5")) == str(out / "checkpoint-5")  # written
    assert hf_trainer.resume_point(str(tmp_path / "none"), None) is None                             # elsewhere
    with pytest.raises(SystemExit) as e:
        hf_trainer.resume_point(str(out), str(tmp_path / "nowhere"))
    assert e.value.code == 2 and "is not a folder" in capsys.readouterr().out
