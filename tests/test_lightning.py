"""An unchanged Lightning script under hpcjobs (trainers/integrations/lightning.py), 2 local ranks on gloo: one
Ctrl-C saves at the batch all ranks agree on, mid-epoch, and exits before the code after fit(); the same command
resumes there and finishes; the losses step by step and the final weights equal an uninterrupted run's. With the
hooks off (HPCJOBS_HOOKS=0) nothing is saved and the same command starts over."""

from __future__ import annotations

import signal
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import ctrl_c_runs
import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler

from conftest import REPO, hpcjobs
from trainers.checkpoint.state import rng_state
from trainers.integrations import CHECK_EVERY, lightning, marks
from trainers.integrations.lightning_data import SkipFirst, rewind

SCRIPT = REPO / "tests" / "scripts" / "lightning_script.py"
STEPS, PER_EPOCH = 30, 10


FOUR = ["--devices", "4", "--samples", "160", "--adamw"]
"""The script at 4 ranks (10 batches a rank and epoch again), with AdamW and a cosine LR stepped every step: where
the order of a gradient all-reduce's additions depends on DDP's bucket layout (trainers/ddp_buckets.py)."""


def command(tmp_path: Path, name: str, ranks: int = 2) -> list[str]:
    return ["submit", "--profile", "local", "--gpus", str(ranks), "--run-dir", str(tmp_path / f"run-{name}"),
            *ctrl_c_runs.CHECKS, str(SCRIPT), "--out", str(tmp_path / name), "--sample_seconds", "0.01",
            *(FOUR if ranks == 4 else [])]


def losses(output: str) -> dict[int, str]:
    return {int(w[1]): w[2] for w in (line.split() for line in output.splitlines()) if w[:1] == ["LOSS"]}


def uninterrupted(folder: Path, ranks: int) -> tuple[Path, dict[int, str]]:
    folder.mkdir(exist_ok=True)
    done = hpcjobs(*command(folder, "twin", ranks), cwd=folder, timeout=600)
    assert done.returncode == 0 and "AFTER FIT" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(losses(done.stdout)) == list(range(1, STEPS + 1))
    return folder / "twin", losses(done.stdout)


@pytest.fixture(scope="module")
def twin(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, str]]:
    """The uninterrupted run every interrupted one is compared with."""
    return uninterrupted(tmp_path_factory.mktemp("lightning"), 2)


def interrupt(tmp_path: Path, after: int, env: dict[str, str] | None = None, ranks: int = 2) -> str:
    """Run the script and send one Ctrl-C once `after` steps logged (tests/ctrl_c_runs.py)."""
    return ctrl_c_runs.interrupt(command(tmp_path, "out", ranks), tmp_path, losses, after, env)


@pytest.mark.train
def test_ctrl_c_saves_mid_epoch_and_the_same_command_resumes_exactly(tmp_path: Path,
                                                                      twin: tuple[Path, dict[int, str]]) -> None:
    stopped_and_resumed_exactly(tmp_path, twin, 2)


@pytest.mark.train
def test_at_4_ranks_with_adamw_and_a_per_step_schedule_the_resume_is_exact(tmp_path: Path) -> None:
    """Issue 42: at 4 ranks a resumed start reduced its first step in DDP's first bucket layout, the uninterrupted run
    in the rebuilt one; the final weights then differed by a rounding unit (trainers/ddp_buckets.py)."""
    stopped_and_resumed_exactly(tmp_path, uninterrupted(tmp_path / "twin-run", 4), 4)
    assert (tmp_path / "run-out" / "ddp-buckets.json").is_file()


def stopped_and_resumed_exactly(tmp_path: Path, twin: tuple[Path, dict[int, str]], ranks: int) -> None:
    first = interrupt(tmp_path, after=12, ranks=ranks)  # into the second epoch: its order comes from its epoch
    out, root = tmp_path / "out", tmp_path / "run-out" / "checkpoints" / lightning.FOLDER
    done = [n for n, p in marks.checkpoints(root) if (p / marks.COMPLETE).is_file()]
    assert len(done) == 1 and 12 <= done[0] < STEPS and done[0] % PER_EPOCH, first[-3000:]  # mid-epoch
    assert done[0] % ctrl_c_runs.EVERY == 1  # the step end after a check
    stop = done[0]
    assert max(losses(first)) == stop  # stopped at the agreed step, on every rank
    assert "AFTER FIT" not in first and not (out / "after-fit.txt").exists()  # nothing after fit() on a stop

    again = hpcjobs(*command(tmp_path, "out", ranks), cwd=tmp_path, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"resuming from {root / f'checkpoint-{stop}'}" in again.stdout
    assert sorted(losses(again.stdout)) == list(range(stop + 1, STEPS + 1))  # only the steps after the stop
    assert {**losses(first), **losses(again.stdout)} == twin[1]  # bit for bit: the repr of every float
    assert (out / "after-fit.txt").read_text() == "ran\n"  # once, after the training that finished
    mine, theirs = torch.load(out / "final.pt"), torch.load(twin[0] / "final.pt")
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    ctrl_c_runs.one_account(tmp_path / "run-out", STEPS)


@pytest.mark.train
def test_with_the_hooks_off_nothing_is_saved_and_the_same_command_starts_over(
        tmp_path: Path, twin: tuple[Path, dict[int, str]]) -> None:
    """The negative control: the comparison above fails without hpcjobs's integration."""
    first = interrupt(tmp_path, after=12, env={"HPCJOBS_HOOKS": "0"})
    assert not marks.checkpoints(tmp_path / "run-out" / "checkpoints" / lightning.FOLDER), first[-3000:]
    again = hpcjobs(*command(tmp_path, "out"), cwd=tmp_path, timeout=600, env={"HPCJOBS_HOOKS": "0"})
    assert "resuming" not in again.stdout and min(losses(again.stdout)) == 1  # from step 0 again


def test_a_skipped_epoch_start_draws_the_same_order_and_skips_by_index() -> None:
    """The resumed epoch's batches are the uninterrupted epoch's last ones, in its order (a RandomSampler draws it
    from the global RNG, restored for the draw), and the RNG stream after the skip is the caller's."""
    loader = DataLoader(list(range(40)), batch_size=4, sampler=RandomSampler(range(40)))
    torch.manual_seed(1)
    whole = SkipFirst(loader.batch_sampler, 0, None, torch.device("cpu"))
    order = list(whole)
    torch.manual_seed(2)
    before = torch.get_rng_state()
    resumed = SkipFirst(loader.batch_sampler, 3, whole.first_rng, torch.device("cpu"))
    assert list(resumed) == order[3:] and len(resumed) == 10 and torch.equal(torch.get_rng_state(), before)
    assert list(resumed) != order  # the skip is for the resumed epoch only; the next one draws anew


def test_an_iterable_dataset_cannot_be_skipped_into_and_one_line_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self) -> Any:
            return iter(range(8))

    loader, fetched = DataLoader(Stream(), batch_size=2), []
    loop = SimpleNamespace(_combined_loader=SimpleNamespace(flattened=[loader]), _data_fetcher=fetched,
                           epoch_loop=SimpleNamespace(batch_progress=SimpleNamespace(current=SimpleNamespace(ready=3))),
                           epoch_progress=SimpleNamespace(current=SimpleNamespace(processed=1)))
    trainer = SimpleNamespace(fit_loop=loop, strategy=SimpleNamespace(root_device=torch.device("cpu")))
    rewind(trainer, {"rng": rng_state(torch.device("cpu")), "first_rng": None})
    said = capsys.readouterr().out.strip().splitlines()
    assert len(said) == 1 and "Stream" in said[0] and "from batch 3" in said[0] and "HINT:" in said[0]
    assert loader.batch_sampler.__class__ is torch.utils.data.BatchSampler  # left as it is


@pytest.mark.train
def test_fit_runs_with_lightnings_own_stop_handling_off_and_gives_the_signals_back(tmp_path: Path) -> None:
    """In-process, one rank, no hpcjobs launch: Lightning installs no SIGTERM or SIGUSR1 handler of its own, the
    protocol's handlers hold during fit() only, and the code after fit() has the script's own signals back."""
    import lightning.pytorch as pl
    from lightning.fabric.plugins.environments import SLURMEnvironment

    lightning.attach(pl.trainer.trainer)

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler  # the protocol's, meanwhile
            return self.layer(batch[0]).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    environment = SLURMEnvironment(auto_requeue=True)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer._accelerator_connector.cluster_environment = environment  # as Lightning picks it inside a Slurm job
    lightning.own_stop_handling_off(trainer)
    before = {n: signal.getsignal(n) for n in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    trainer.fit(Tiny(), DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 2)), batch_size=2))
    assert trainer.global_step == 2 and not environment.auto_requeue
    assert {n: signal.getsignal(n) for n in before} == before


@pytest.fixture(autouse=True)
def _signals_given_back() -> Any:
    """A stop ends fit() with SystemExit and the protocol's handlers still in place (the rank's process ends there);
    in one test process the next test must start with the handlers it had."""
    nums = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
    saved = {n: signal.getsignal(n) for n in nums}
    yield
    for n, handler in saved.items():
        signal.signal(n, handler)


@pytest.mark.train
@pytest.mark.parametrize(("asked", "saved"), [(13, 13), (10, 11)])
def test_in_one_process_a_stop_mid_epoch_resumes_with_a_random_sampler_exactly(tmp_path: Path, asked: int, saved: int,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """One rank, no launch: the stop's checkpoint and the resume around a RandomSampler (its order drawn from the
    global RNG at the epoch's first batch, restored for the draw) and dropout (the RNG streams at the stop). A stop
    asked on an epoch's last batch (10) waits for the next batch: the epoch's end (its LR step) runs first."""
    import lightning.pytorch as pl

    from trainers import preemption

    lightning.attach(pl.trainer.trainer)
    monkeypatch.setenv(CHECK_EVERY, "1")  # the default, about once a second, would not check again after batch 12

    class Net(pl.LightningModule):
        def __init__(self, stop_at: int) -> None:
            super().__init__()
            self.net, self.stop_at, self.losses = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3),
                                                                       torch.nn.Linear(8, 1)), stop_at, {}
            self.seen: list[int] = []

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            if self.global_step + 1 == self.stop_at:
                preemption.request_stop(signal.SIGINT)  # as Ctrl-C would
            loss = self.net(batch[0]).pow(2).mean()
            self.losses[self.global_step + 1] = loss.item()
            return loss

        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]

        def train_dataloader(self) -> DataLoader:
            data = torch.utils.data.TensorDataset(torch.randn(40, 4, generator=torch.Generator().manual_seed(0)))
            return DataLoader(data, batch_size=4, shuffle=True)

    def run(stop_at: int) -> Net:
        torch.manual_seed(0)
        model = Net(stop_at)
        pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path).fit(model)
        return model

    twin = run(stop_at=0)
    with pytest.raises(SystemExit) as stopped:
        run(stop_at=asked)
    preemption.reset()  # what the process's exit would do
    done = [n for n, p in marks.checkpoints(tmp_path / "hpcjobs-checkpoints") if (p / marks.COMPLETE).is_file()]
    assert stopped.value.code == 0 and done == [saved]
    resumed = run(stop_at=0)
    assert sorted(resumed.losses) == list(range(saved + 1, 21))
    assert all(resumed.losses[k] == twin.losses[k] for k in resumed.losses)
    mine, theirs = resumed.state_dict(), twin.state_dict()
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
