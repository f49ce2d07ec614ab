"""An unchanged Hugging Face Trainer script under hpcjobs (trainers/integrations/hf_trainer.py), 2 local ranks on
gloo: one Ctrl-C saves at the step all ranks agree on and exits before the code after train(); the same command
resumes at that step and finishes; the losses step by step and the final weights equal an uninterrupted run's."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import ctrl_c_runs
import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, hpcjobs
from hpcjobs.protocol.contract import ENV_VAR, LaunchContract
from trainers.integrations import hf_trainer, marks

SCRIPT = REPO / "tests" / "scripts" / "hf_trainer_script.py"
STEPS = 30


def command(tmp_path: Path, name: str, *more: str, ranks: int = 2) -> list[str]:
    return ["submit", "--profile", "local", "--gpus", str(ranks), "--run-dir", str(tmp_path / f"run-{name}"),
            *ctrl_c_runs.CHECKS, str(SCRIPT), "--output_dir", str(tmp_path / name), "--max_steps", str(STEPS), *more]


def loss_lines(said: str) -> list[str]:
    return [line for line in said.splitlines() if line.startswith("{'loss'")]


def interrupt(tmp_path: Path, *more: str, env: dict[str, str] | None = None) -> str:
    """Run the script and send one Ctrl-C once 7 steps logged (tests/ctrl_c_runs.py): everything it printed."""
    return ctrl_c_runs.interrupt(command(tmp_path, "out", *more), tmp_path, loss_lines, 7, env)


def losses(out: Path) -> list[tuple[int, float]]:
    state = json.loads((out / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    return [(h["step"], h["loss"]) for h in state["log_history"] if "loss" in h]


@pytest.fixture(scope="module")
def twin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run every interrupted one is compared with."""
    folder = tmp_path_factory.mktemp("hf")
    done = hpcjobs(*command(folder, "twin"), cwd=folder, timeout=600)
    assert done.returncode == 0 and "AFTER TRAIN" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    return folder / "twin"


def same_as(out: Path, twin: Path) -> None:
    assert losses(out) == losses(twin)
    mine, theirs = load_file(out / "final" / "model.safetensors"), load_file(twin / "final" / "model.safetensors")
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


@pytest.mark.train
def test_ctrl_c_saves_at_the_agreed_step_and_the_same_command_resumes_exactly(tmp_path: Path, twin: Path) -> None:
    first = interrupt(tmp_path)
    out = tmp_path / "out"
    done = [n for n, p in marks.checkpoints(out) if (p / marks.COMPLETE).is_file()]
    assert done and 7 <= done[-1] < STEPS and done[-1] % ctrl_c_runs.EVERY == 1, first[-3000:]  # after a check
    stop = done[-1]
    assert "AFTER TRAIN" not in first and not (out / "after-train.txt").exists()  # nothing after train() on a stop
    assert not (out / f"checkpoint-{stop}" / marks.PENDING).exists()
    # The case that applies, and what the user did (issue 37: "any other script is stopped now ... saves nothing").
    assert "stopping (Ctrl-C): this script commits a checkpoint at its next step all ranks agree on" in first
    assert f"stopped by Ctrl-C at step {stop} with a committed checkpoint" in first

    again = hpcjobs(*command(tmp_path, "out"), cwd=tmp_path, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"resuming from {out / f'checkpoint-{stop}'}" in again.stdout
    assert len(loss_lines(again.stdout)) == STEPS - stop  # the second start trained only the steps after the stop
    assert (out / "after-train.txt").read_text() == "ran\n"  # once, after the training that finished

    same_as(out, twin)
    ctrl_c_runs.one_account(tmp_path / "run-out", STEPS)


@pytest.mark.train
def test_at_4_ranks_with_ddp_rebuilding_its_buckets_the_resume_is_exact(tmp_path: Path) -> None:
    """Issue 42: at 4 ranks the order of the gradient all-reduce's additions follows DDP's bucket layout, which a
    resumed start must have from its first step (trainers/ddp_buckets.py). The Trainer lets DDP rebuild its buckets
    when `ddp_find_unused_parameters` is false (its own choice under activation checkpointing); AdamW and the linear
    schedule step every step, GPT-2's dropout is on."""
    rebuilt = ("--ddp_find_unused_parameters", "false")
    done = hpcjobs(*command(tmp_path, "twin", *rebuilt, ranks=4), cwd=tmp_path, timeout=600)
    assert done.returncode == 0 and "AFTER TRAIN" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    first = ctrl_c_runs.interrupt(command(tmp_path, "out", *rebuilt, ranks=4), tmp_path, loss_lines, 7)
    assert "AFTER TRAIN" not in first, first[-3000:]
    again = hpcjobs(*command(tmp_path, "out", *rebuilt, ranks=4), cwd=tmp_path, timeout=600)
    assert again.returncode == 0 and "resuming from" in again.stdout, again.stdout[-3000:] + again.stderr[-3000:]
    same_as(tmp_path / "out", tmp_path / "twin")


@pytest.mark.train
def test_with_the_hooks_off_nothing_is_saved_at_the_stop_and_the_steps_are_trained_again(tmp_path: Path) -> None:
    """The negative control: HPCJOBS_HOOKS=0 leaves the script as it is. Ctrl-C ends it at once (the script's own
    saves are off here: --save_steps beyond the run), nothing is saved at the stop, and the same command trains
    every step again: the test above fails on both counts."""
    first = interrupt(tmp_path, "--save_steps", "1000", env={"HPCJOBS_HOOKS": "0"})
    out = tmp_path / "out"
    assert 7 <= len(loss_lines(first)) < STEPS and not marks.checkpoints(out), first[-3000:]
    assert "AFTER TRAIN" not in first
    again = hpcjobs(*command(tmp_path, "out", "--save_steps", "1000"), cwd=tmp_path, timeout=600,
                    env={"HPCJOBS_HOOKS": "0"})
    assert again.returncode == 0 and "resuming" not in again.stdout, again.stdout[-3000:] + again.stderr[-3000:]
    assert len(loss_lines(again.stdout)) == STEPS  # the steps before the Ctrl-C, trained a second time


@pytest.mark.train
def test_a_rank_killed_inside_a_save_leaves_a_checkpoint_never_resumed(tmp_path: Path, twin: Path) -> None:
    """Rank 1 SIGKILLed after writing checkpoint-20's files, before every rank's were durable: the job fails, the
    next start moves checkpoint-20 aside, resumes checkpoint-10, and still ends with the uninterrupted weights."""
    killed = hpcjobs(*ctrl_c_runs.without_recovery(command(tmp_path, "out")), cwd=tmp_path, timeout=600,
                     env={"HPCJOBS_FAULT_INJECT": "save-written@20:1"})
    assert killed.returncode != 0 and "AFTER TRAIN" not in killed.stdout
    out = tmp_path / "out"
    assert marks.incomplete(out / "checkpoint-20") and (out / "checkpoint-10" / marks.COMPLETE).is_file()
    again = hpcjobs(*command(tmp_path, "out"), cwd=tmp_path, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "checkpoint-20 was left incomplete" in again.stdout and f"resuming from {out / 'checkpoint-10'}" in \
        again.stdout
    assert (out / marks.ASIDE / "checkpoint-20").is_dir()
    same_as(out, twin)


def test_an_incomplete_checkpoint_is_moved_aside_and_the_one_before_is_resumed(tmp_path: Path,
                                                                               capsys: pytest.CaptureFixture[str]) \
        -> None:
    """A save killed halfway leaves its pending mark and no completion mark: never resumed, moved aside, also
    when the script's own get_last_checkpoint hands it to train()."""
    out = tmp_path / "out"
    for step, names in ((10, [marks.COMPLETE]), (20, [marks.PENDING]), (5, [])):
        folder = out / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        for mark in names:
            (folder / mark).write_text("{}")
    assert hf_trainer.resume_point(str(out), str(out / "checkpoint-20")) == str(out / "checkpoint-10")
    assert (out / marks.ASIDE / "checkpoint-20").is_dir() and not (out / "checkpoint-20").exists()
    assert "left incomplete" in capsys.readouterr().out
    assert hf_trainer.resume_point(str(out), None) == str(out / "checkpoint-10")
    assert hf_trainer.resume_point(str(out), str(out / "checkpoint-5")) == str(out / "checkpoint-5")  # written
    assert hf_trainer.resume_point(str(tmp_path / "none"), None) is None                             # elsewhere
    with pytest.raises(SystemExit) as e:
        hf_trainer.resume_point(str(out), str(tmp_path / "nowhere"))
    assert e.value.code == 2 and "is not a folder" in capsys.readouterr().out


def test_an_output_folder_that_cannot_be_written_is_refused_in_one_line(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as e:
        hf_trainer.resume_point(str(tmp_path / "file" / "out"), None)
    said = capsys.readouterr().out.strip().splitlines()
    assert e.value.code == 2 and len(said) == 1 and "cannot hold checkpoints" in said[0] and "HINT:" in said[0]


def test_a_data_skip_turned_off_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """The data the script cannot skip into: with ignore_data_skip a resumed epoch would train its first batches
    again (issue 25's bad inputs)."""
    from types import SimpleNamespace

    hf_trainer.skippable(SimpleNamespace(ignore_data_skip=False))
    with pytest.raises(SystemExit) as e:
        hf_trainer.skippable(SimpleNamespace(ignore_data_skip=True))
    said = capsys.readouterr().out.strip().splitlines()
    assert e.value.code == 2 and len(said) == 1 and "ignore_data_skip is set" in said[0] and "HINT:" in said[0]


def test_an_output_folder_renamed_at_each_start_resumes_the_previous_starts_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A requeued start whose --output_dir holds a new timestamp finds no checkpoint of its own: it resumes the one
    the job's previous start recorded in the run folder, and says why."""
    run = tmp_path / "run"
    monkeypatch.setenv(ENV_VAR, LaunchContract(str(run)).to_json())
    before = tmp_path / "out-1200" / "checkpoint-30"
    before.mkdir(parents=True)
    monkeypatch.setenv("RANK", "0")
    marks.mark_complete(before, 30)
    assert hf_trainer.resume_point(str(tmp_path / "out-1300"), None) == str(before)
    assert "its name changes every start" in capsys.readouterr().out
    assert hf_trainer.resume_point(str(tmp_path / "out-1200"), None) == str(before)  # its own: no word


@pytest.mark.train
def test_the_code_around_train_keeps_the_scripts_signals(tmp_path: Path) -> None:
    """The protocol's handlers hold only while train() runs: Ctrl-C stops the code before and after it as usual
    (they were installed when the Trainer was made and never given back: the code after train() ignored Ctrl-C)."""
    import transformers

    hf_trainer.attach(transformers.trainer)
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    before = {n: signal.getsignal(n) for n in (signal.SIGINT, signal.SIGTERM)}
    during = []

    class Look(TrainerCallback):
        def on_step_end(self, *_: object, **__: object) -> None:
            during.append(signal.getsignal(signal.SIGINT))

    ids = torch.arange(16).remainder(32)
    trainer = Trainer(model=GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=16, n_embd=8, n_layer=1, n_head=1)),
                      args=TrainingArguments(output_dir=str(tmp_path), max_steps=2, report_to=[], use_cpu=True,
                                             save_strategy="no", disable_tqdm=True),
                      train_dataset=[{"input_ids": ids, "labels": ids}] * 4, callbacks=[Look()])
    assert {n: signal.getsignal(n) for n in before} == before
    trainer.train()
    assert during and during[0] is not before[signal.SIGINT]  # the protocol's, meanwhile
    assert {n: signal.getsignal(n) for n in before} == before


def test_a_checkpoint_another_run_completed_is_not_resumed_without_a_word(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 37: a 400-step run finished in OUT, then another command (another run folder) with the same
    --output_dir: plain HF starts at 0, and so does this run, saying why; its own checkpoints it resumes; the run
    that completed the checkpoint resumes it silently; a script that asks for it gets it, with a word."""
    out, monkeypatch_run = tmp_path / "out", lambda run: monkeypatch.setenv(ENV_VAR, LaunchContract(str(run)).to_json())
    monkeypatch.setenv("RANK", "0")
    monkeypatch_run(tmp_path / "run-a")
    (old := out / "checkpoint-400").mkdir(parents=True)
    marks.mark_complete(old, 400)
    assert hf_trainer.resume_point(str(out), None) == str(old) and "another run" not in capsys.readouterr().out
    monkeypatch_run(tmp_path / "run-b")
    assert hf_trainer.resume_point(str(out), None) is None
    said = capsys.readouterr().out.strip().splitlines()
    assert len(said) == 1 and f"{old} was completed by another run ({tmp_path / 'run-a'})" in said[0], said
    assert "this run starts at step 0" in said[0] and "HINT:" in said[0]
    (mine := out / "checkpoint-100").mkdir()
    marks.mark_complete(mine, 100)
    assert hf_trainer.resume_point(str(out), None) == str(mine)
    assert f"resuming {mine}, the newest of this run" in capsys.readouterr().out
    assert hf_trainer.resume_point(str(out), str(old)) == str(old)
    assert "which another run completed" in capsys.readouterr().out
