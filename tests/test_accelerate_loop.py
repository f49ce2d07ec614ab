"""An accelerate loop with hpcjobs's one line (trainers/integrations/accelerate_loop.py), 2 local ranks on gloo,
`Accelerator(cpu=True)`: one Ctrl-C saves at the step all ranks agree on, mid-epoch, and exits before the code after
the loop; the same command resumes there and finishes; the losses step by step and the final weights equal an
uninterrupted run's. With the hooks off (HPCJOBS_HOOKS=0) nothing is saved and the same command starts over. A rank
SIGKILLed inside a save leaves a state that is never resumed."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import ctrl_c_runs
import pytest
import torch
from torch.utils.data import DataLoader

from conftest import REPO, hpcjobs
from trainers.integrations import CHECK_EVERY, accelerate_loop, marks

SCRIPT = REPO / "trainers" / "examples" / "accelerate_script.py"
STEPS, PER_EPOCH = 30, 10


FOUR = ["--samples", "160", "--adamw"]
"""The script at 4 ranks (10 batches a rank and epoch again), with AdamW and a cosine LR stepped every step."""


def command(tmp_path: Path, name: str, *extra: str, ranks: int = 2) -> list[str]:
    extra = (*extra, *FOUR) if ranks == 4 else extra
    return ["submit", "--profile", "local", "--gpus", str(ranks), "--run-dir", str(tmp_path / f"run-{name}"),
            *ctrl_c_runs.CHECKS, str(SCRIPT), "--out", str(tmp_path / name), "--sample_seconds", "0.01", *extra]


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
    """Run the script and send one Ctrl-C once `after` steps logged (tests/ctrl_c_runs.py)."""
    return ctrl_c_runs.interrupt(command(tmp_path, "out"), tmp_path, losses, after, env)


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
    assert done[0] % ctrl_c_runs.EVERY == 1  # the step end after a check
    stop = done[0]
    assert max(losses(first)) == stop  # stopped at the agreed step, on every rank
    assert "AFTER LOOP" not in first and not (out / "after-loop.txt").exists()  # nothing after the loop on a stop

    again = hpcjobs(*command(tmp_path, "out"), cwd=tmp_path, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"resuming from {root(tmp_path) / f'checkpoint-{stop}'}" in again.stdout
    assert resumed_exactly(first, again.stdout, out, twin) == []
    assert (out / "after-loop.txt").read_text() == "ran\n"  # once, after the training that finished
    ctrl_c_runs.one_account(tmp_path / "run-out", STEPS, losses=False)


@pytest.mark.train
def test_at_4_ranks_with_adamw_and_a_per_step_schedule_the_resume_is_exact(tmp_path: Path) -> None:
    """Issue 42: at 4 ranks the order of the gradient all-reduce's additions follows DDP's bucket layout, which a
    resumed start must have from its first step (trainers/ddp_buckets.py); the twin runs in the same test."""
    done = hpcjobs(*command(tmp_path, "twin", ranks=4), cwd=tmp_path, timeout=600)
    assert done.returncode == 0 and "AFTER LOOP" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    first = ctrl_c_runs.interrupt(command(tmp_path, "out", ranks=4), tmp_path, losses, 12)
    assert len(complete(tmp_path)) == 1 and "AFTER LOOP" not in first, first[-3000:]
    again = hpcjobs(*command(tmp_path, "out", ranks=4), cwd=tmp_path, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert resumed_exactly(first, again.stdout, tmp_path / "out", (tmp_path / "twin", losses(done.stdout))) == []


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
    killed = hpcjobs(*ctrl_c_runs.without_recovery(command(tmp_path, "out", "--save_every", "10")), cwd=tmp_path,
                     timeout=600, env={"HPCJOBS_FAULT_INJECT": "save-written@20:1"})
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


@pytest.fixture
def _signals_given_back() -> Any:
    """A stop ends the loop with SystemExit and the protocol's handlers in place (the rank's process ends there); in
    one test process the next test must start with the handlers it had, and no stop request left over."""
    from trainers import preemption

    nums = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
    saved = {n: signal.getsignal(n) for n in nums}
    # Ctrl-C as a terminal's Python has it: a job a shell without job control put in the background (CI scripts,
    # `cmd &`) starts with SIGINT ignored, Python then installs no KeyboardInterrupt handler, and the loop rightly
    # gives that back: these tests failed there (DID NOT RAISE KeyboardInterrupt) and passed in a terminal.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    preemption.reset()
    for n, handler in saved.items():
        signal.signal(n, handler)


@pytest.fixture
def _checks_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stop checked at every step (the default, about once a second, would not check again within these tests'
    millisecond steps once the first 12 are over): a stop asked at step N lands there."""
    monkeypatch.setenv(CHECK_EVERY, "1")


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self) -> Any:
        return iter(torch.randn(40, 4, generator=torch.Generator().manual_seed(0)).unbind())


def train_in_process(states: Path, stop_at: int, accumulate: int = 1,
                     stream: bool = False) -> tuple[dict[int, float], dict[str, Any]]:
    """One rank, no launch, a fresh Accelerator: shuffled data whose order comes from the global RNG (accelerate
    gives a single process's sampler no generator of its own), dropout, momentum, an epoch scheduler."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from trainers import preemption

    AcceleratorState._reset_state(True)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulate)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    data = torch.utils.data.TensorDataset(torch.randn(40, 4, generator=torch.Generator().manual_seed(0)))
    batches = DataLoader(Stream(), batch_size=4) if stream else DataLoader(data, batch_size=4, shuffle=True)
    model, opt, loader, sched = accelerator.prepare(model, opt, batches, sched)
    found: dict[int, float] = {}
    for step, x in accelerate_loop.resumable(accelerator, loader, epochs=3, epoch_end=lambda _: sched.step(),
                                                folder=states):
        if step + 1 == stop_at:
            preemption.request_stop(signal.SIGINT)  # as Ctrl-C would
        x = x if stream else x[0]
        with accelerator.accumulate(model):
            loss = model(x).pow(2).mean()
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
        found[step + 1] = loss.item()
    return found, accelerator.unwrap_model(model).state_dict()


@pytest.mark.train
@pytest.mark.usefixtures("_signals_given_back", "_checks_every_step")
@pytest.mark.parametrize(("asked", "accumulate", "saved"), [(13, 1, 13), (13, 2, 14), (10, 1, 10)])
def test_in_one_process_a_stop_resumes_exactly(tmp_path: Path, asked: int, accumulate: int, saved: int) -> None:
    """The stop's state and the resume around a sampler drawing from the global RNG (restored for the epoch's draw),
    dropout and an epoch scheduler. A stop asked inside a gradient accumulation (13 of 2) waits for its end; one
    asked on an epoch's last step (10) saves after the epoch's own work, and the resume starts the next epoch."""
    from trainers import preemption

    twin_losses, twin_weights = train_in_process(tmp_path / "twin", stop_at=0, accumulate=accumulate)
    assert sorted(twin_losses) == list(range(1, 31)) and not (tmp_path / "twin").exists()
    with pytest.raises(SystemExit) as stopped:
        train_in_process(tmp_path / "states", stop_at=asked, accumulate=accumulate)
    preemption.reset()  # what the process's exit would do
    assert stopped.value.code == 0
    assert [n for n, p in marks.checkpoints(tmp_path / "states") if (p / marks.COMPLETE).is_file()] == [saved]
    resumed, weights = train_in_process(tmp_path / "states", stop_at=0, accumulate=accumulate)
    assert sorted(resumed) == list(range(saved + 1, 31))
    assert all(resumed[k] == twin_losses[k] for k in resumed)
    assert all(torch.equal(weights[k], twin_weights[k]) for k in twin_weights)


@pytest.mark.train
@pytest.mark.usefixtures("_signals_given_back")
def test_the_loop_holds_the_protocols_signals_only_while_it_runs(tmp_path: Path) -> None:
    """Ctrl-C stops the code before and after the loop as usual; inside it, it only asks for a stop."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    before = {n: signal.getsignal(n) for n in (signal.SIGINT, signal.SIGTERM)}
    during = [signal.getsignal(signal.SIGINT) for _ in accelerate_loop.resumable(accelerator, [1, 2], folder=tmp_path)]
    assert len(during) == 2 and during[0] is not before[signal.SIGINT]
    assert {n: signal.getsignal(n) for n in before} == before


@pytest.mark.train
@pytest.mark.usefixtures("_signals_given_back")
def test_a_ctrl_c_after_the_last_agreement_reaches_the_script_as_the_loop_ends(tmp_path: Path) -> None:
    """A Ctrl-C during the last step (no agreement is made there: training is over, nothing to save) is the script's
    once the loop ends: KeyboardInterrupt where the loop returns. Dropped, the code after the loop ran on deaf to
    it."""
    with pytest.raises(KeyboardInterrupt):
        train_in_process(tmp_path / "states", stop_at=30)
    assert not (tmp_path / "states").exists()


@pytest.mark.usefixtures("_signals_given_back")
def test_a_ctrl_c_in_a_step_the_script_then_breaks_out_of_reaches_the_code_after_the_loop(tmp_path: Path) -> None:
    """The script leaves the loop with `break` in the step a Ctrl-C came in: no agreement is made (the loop is never
    asked for the next batch), and the code after the loop is interrupted, as a Ctrl-C there would."""
    from accelerate import Accelerator

    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        for step, _ in accelerate_loop.resumable(Accelerator(cpu=True), [1, 2, 3, 4], folder=tmp_path):
            if step == 1:
                signal.raise_signal(signal.SIGINT)  # the protocol's handler: a flag
                break
        time.sleep(5)  # the script's work after the loop
    assert time.monotonic() - started < 4 and not list(tmp_path.iterdir())


@pytest.mark.usefixtures("_signals_given_back")
def test_the_profiles_signal_after_the_last_agreement_goes_to_the_scripts_own_handler(tmp_path: Path) -> None:
    """Under hpcjobs the handler before the loop is trainers.standby's (rank 0 requeues the job); here a recorder."""
    from accelerate import Accelerator

    from trainers import preemption

    num = preemption.signal_number(preemption.current_contract().preemption.signal)
    got: list[int] = []
    signal.signal(num, lambda signum, _: got.append(signum))
    for step, _ in accelerate_loop.resumable(Accelerator(cpu=True), [1, 2, 3], folder=tmp_path):
        if step == 2:  # the last step: twice, handed over once
            preemption.request_stop(num)
            preemption.request_stop(num)
        assert got == []
    assert got == [num] and not preemption.first_request()
    for _ in accelerate_loop.resumable(Accelerator(cpu=True), [1, 2], folder=tmp_path):
        pass
    assert got == [num]  # nothing left over for the next loop


@pytest.mark.parametrize("bad", [{"epochs": 0}, {"epochs": 1.5}, {"max_steps": 0}, {"save_every": -1},
                                 {"epochs": True}])
def test_a_bad_argument_is_refused_in_one_line(bad: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        accelerate_loop.resumable(object(), [], **bad)
    said = capsys.readouterr().out.strip().splitlines()
    assert e.value.code == 2 and len(said) == 1 and next(iter(bad)) in said[0] and "HINT:" in said[0]


def test_a_stateful_dataloader_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """accelerate restores such a loader's position in load_state: skipping its batches again would skip twice."""
    with pytest.raises(SystemExit) as e:
        accelerate_loop.resumable(object(), type("L", (), {"use_stateful_dataloader": True})())
    said = capsys.readouterr().out.strip().splitlines()
    assert e.value.code == 2 and len(said) == 1 and "stateful" in said[0] and "HINT:" in said[0]


def test_in_hpcjobs_own_folder_a_state_without_its_completion_mark_is_moved_aside(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A rank may write its files of a save before rank 0 wrote the pending mark, and die: in a folder only hpcjobs
    writes, no completion mark means incomplete (elsewhere, a folder with neither mark is a foreign checkpoint)."""
    for step, names in ((10, [marks.COMPLETE]), (20, [marks.PENDING]), (30, [])):
        (tmp_path / f"checkpoint-{step}").mkdir()
        for mark in names:
            (tmp_path / f"checkpoint-{step}" / mark).write_text("{}")
    assert marks.settle(tmp_path, owned=True) == tmp_path / "checkpoint-10"
    assert sorted(p.name for p in (tmp_path / marks.ASIDE).iterdir()) == ["checkpoint-20", "checkpoint-30"]
    assert capsys.readouterr().out.count("left incomplete") == 2


def test_a_state_saved_by_another_number_of_ranks_is_refused_in_one_line(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "checkpoint-12"
    folder.mkdir()
    torch.save({"world_size": 4}, folder / accelerate_loop.POSITION.format(rank=0))
    (folder / marks.COMPLETE).write_text("{}")
    loop = accelerate_loop.Loop(type("A", (), {"num_processes": 2})(), [], 1, None, 0, None, tmp_path)
    with pytest.raises(SystemExit) as e:
        loop.resume()
    said = capsys.readouterr().out.strip().splitlines()
    assert e.value.code == 2 and len(said) == 1 and "by 4 ranks" in said[0] and "HINT:" in said[0]


def test_a_save_goes_where_hpcjobs_says_also_with_automatic_checkpoint_naming() -> None:
    from accelerate.utils import ProjectConfiguration

    holder = type("A", (), {"project_configuration": ProjectConfiguration(automatic_checkpoint_naming=True,
                                                                           iteration=3)})()
    with accelerate_loop.explicit_folder(holder):
        assert not holder.project_configuration.automatic_checkpoint_naming
        holder.project_configuration.iteration += 1  # what save_state does
    assert holder.project_configuration.automatic_checkpoint_naming and holder.project_configuration.iteration == 3


def test_the_generators_a_loader_draws_from_are_found_once_each() -> None:
    gen = torch.Generator()
    loader = DataLoader(list(range(8)), batch_size=2, sampler=torch.utils.data.RandomSampler(range(8), generator=gen),
                        generator=gen)
    assert accelerate_loop.generators(loader) == [gen]
    assert accelerate_loop.generators(DataLoader(list(range(8)), batch_size=2)) == []


@pytest.mark.train
@pytest.mark.usefixtures("_signals_given_back", "_checks_every_step")
def test_an_iterable_dataset_is_skipped_into_by_reading_it_again_and_one_line_says_so(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from trainers import preemption

    twin_losses, twin_weights = train_in_process(tmp_path / "twin", stop_at=0, stream=True)
    with pytest.raises(SystemExit):
        train_in_process(tmp_path / "states", stop_at=14, stream=True)
    preemption.reset()
    capsys.readouterr()
    resumed, weights = train_in_process(tmp_path / "states", stop_at=0, stream=True)
    said = [line for line in capsys.readouterr().out.splitlines() if "cannot be skipped into" in line]
    assert len(said) == 1 and "Stream" in said[0] and "first 4 batches" in said[0]
    assert sorted(resumed) == list(range(15, 31)) and all(resumed[k] == twin_losses[k] for k in resumed)
    assert all(torch.equal(weights[k], twin_weights[k]) for k in twin_weights)


def test_a_save_into_a_folder_an_earlier_save_completed_is_incomplete_until_it_completes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    folder = tmp_path / "checkpoint-20"
    marks.mark_pending(folder)
    marks.mark_complete(folder, 20)
    assert not marks.incomplete(folder)
    marks.mark_pending(folder)  # a run that went back to step 10 saves step 20 again
    assert marks.incomplete(folder) and marks.settle(tmp_path, owned=True) is None
