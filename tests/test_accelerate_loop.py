"""An accelerate loop with hpcjobs's one line (trainers/integrations/accelerate_loop.py), 2 local ranks on gloo,
`Accelerator(cpu=True)`: one Ctrl-C saves at the step all ranks agree on, mid-epoch, and exits before the code after
the loop; the same command resumes there and finishes; the losses step by step and the final weights equal an
uninterrupted run's. With the hooks off (HPCJOBS_HOOKS=0) nothing is saved and the same command starts over. A rank
SIGKILLed inside a save leaves a state that is never resumed."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from conftest import BIN, REPO, hpcjobs
from trainers.integrations import accelerate_loop, marks

SCRIPT = REPO / "tests" / "scripts" / "accelerate_script.py"
STEPS, PER_EPOCH = 30, 10


def command(tmp_path: Path, name: str, *extra: str) -> list[str]:
    return ["submit", "--profile", "local", "--gpus", "2", "--run-dir", str(tmp_path / f"run-{name}"), str(SCRIPT),
            "--out", str(tmp_path / name), "--sample_seconds", "0.01", *extra]


def losses(output: str) -> dict[int, str]:
    return {int(w[1]): w[2] for w in (line.split() for line in output.splitlines()) if w[:1] == ["LOSS"]}


def root(tmp_path: Path) -> Path:
    return tmp_path / "run-out" / "checkpoints" / accelerate_loop.FOLDER


def complete(tmp_path: Path) -> list[int]:
    return [n for n, p in marks.checkpoints(root(tmp_path)) if (p / marks.COMPLETE).is_file()]


@pytest.fixture(scope="module")
def twin(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, str]]:
    """The uninterrupted run every interrupted one is compared with."""
    folder = tmp_path_factory.mktemp("accelerate")
    done = hpcjobs(*command(folder, "twin"), cwd=folder, timeout=600)
    assert done.returncode == 0 and "AFTER LOOP" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(losses(done.stdout)) == list(range(1, STEPS + 1))
    assert not marks.checkpoints(folder / "run-twin" / "checkpoints" / accelerate_loop.FOLDER)  # no stop: no save
    return folder / "twin", losses(done.stdout)


def interrupt(tmp_path: Path, after: int, env: dict[str, str] | None = None) -> str:
    """Run the script and send one Ctrl-C (SIGINT to the command, as a terminal does) once `after` steps logged."""
    proc = subprocess.Popen([str(BIN / "hpcjobs"), *command(tmp_path, "out")], cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    assert proc.stdout is not None
    seen, deadline = [], time.time() + 300
    while len(losses("".join(seen))) < after:
        line = proc.stdout.readline()
        assert line and time.time() < deadline, "".join(seen)[-3000:]
        seen.append(line)
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=300)
    return "".join(seen) + rest


def same_weights(out: Path, twin: Path) -> bool:
    mine, theirs = torch.load(out / "final.pt"), torch.load(twin / "final.pt")
    return mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def resumed_exactly(first: str, again: str, out: Path, twin: tuple[Path, dict[int, str]]) -> list[str]:
    """What differs from an uninterrupted run when the first start's steps and the second's are put together."""
    stop, after = max(losses(first)), losses(again)
    wrong = [] if sorted(after) == list(range(stop + 1, STEPS + 1)) else [f"the second start ran steps {sorted(after)}"]
    stitched = {**losses(first), **{k: v for k, v in after.items() if k > stop}}
    wrong += [f"loss of step {k}" for k in sorted(twin[1]) if stitched.get(k) != twin[1][k]]  # the repr of each float
    return wrong + ([] if same_weights(out, twin[0]) else ["final weights"])


@pytest.mark.train
def test_ctrl_c_saves_mid_epoch_and_the_same_command_resumes_exactly(tmp_path: Path,
                                                                      twin: tuple[Path, dict[int, str]]) -> None:
    first = interrupt(tmp_path, after=12)  # into the second epoch: its order is drawn anew from the generator
    out, done = tmp_path / "out", complete(tmp_path)
    assert len(done) == 1 and 12 <= done[0] < STEPS and done[0] % PER_EPOCH, first[-3000:]  # mid-epoch
    stop = done[0]
    assert max(losses(first)) == stop  # stopped at the agreed step, on every rank
    assert "AFTER LOOP" not in first and not (out / "after-loop.txt").exists()  # nothing after the loop on a stop

    again = hpcjobs(*command(tmp_path, "out"), cwd=tmp_path, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"resuming from {root(tmp_path) / f'checkpoint-{stop}'}" in again.stdout
    assert resumed_exactly(first, again.stdout, out, twin) == []
    assert (out / "after-loop.txt").read_text() == "ran\n"  # once, after the training that finished


@pytest.mark.train
def test_with_the_hooks_off_nothing_is_saved_and_the_comparison_fails(tmp_path: Path,
                                                                     twin: tuple[Path, dict[int, str]]) -> None:
    """The negative control: HPCJOBS_HOOKS=0 makes `resumable` the plain loop, and the comparison above fails."""
    first = interrupt(tmp_path, after=12, env={"HPCJOBS_HOOKS": "0"})
    assert not marks.checkpoints(root(tmp_path)) and "AFTER LOOP" not in first, first[-3000:]
    again = hpcjobs(*command(tmp_path, "out"), cwd=tmp_path, timeout=600, env={"HPCJOBS_HOOKS": "0"})
    assert again.returncode == 0 and "resuming" not in again.stdout and min(losses(again.stdout)) == 1
    assert resumed_exactly(first, again.stdout, tmp_path / "out", twin) != []


@pytest.mark.train
def test_a_rank_killed_inside_a_save_leaves_a_state_never_resumed(tmp_path: Path,
                                                                   twin: tuple[Path, dict[int, str]]) -> None:
    """Saves every 10 steps; rank 1 SIGKILLed after writing checkpoint-20's files, before every rank's were durable:
    the job fails, the next start moves checkpoint-20 aside, resumes checkpoint-10, and still ends with the
    uninterrupted weights."""
    killed = hpcjobs(*command(tmp_path, "out", "--save_every", "10"), cwd=tmp_path, timeout=600,
                     env={"HPCJOBS_FAULT_INJECT": "save-written@20:1"})
    assert killed.returncode != 0 and "AFTER LOOP" not in killed.stdout
    folder = root(tmp_path)
    assert complete(tmp_path) == [10] and not (folder / "checkpoint-20" / marks.COMPLETE).exists()
    again = hpcjobs(*command(tmp_path, "out", "--save_every", "10"), cwd=tmp_path, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "checkpoint-20 was left incomplete" in again.stdout
    assert f"resuming from {folder / 'checkpoint-10'}" in again.stdout
    assert (folder / marks.ASIDE / "checkpoint-20").is_dir()
    assert sorted(losses(again.stdout)) == list(range(11, STEPS + 1))
    assert {k: v for k, v in losses(again.stdout).items()} == {k: twin[1][k] for k in range(11, STEPS + 1)}
    assert same_weights(tmp_path / "out", twin[0])
