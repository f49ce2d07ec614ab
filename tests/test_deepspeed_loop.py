"""A raw `deepspeed.initialize` loop with hpcjobs's one line (trainers/integrations/deepspeed_loop.py), 2 local ranks
on CPU and gloo, ZeRO-2 and ZeRO-3: one Ctrl-C saves DeepSpeed's own checkpoint at the step all ranks agree on,
mid-epoch, and exits before the code after the loop; **the same command again** (no --run-dir) resumes there and
finishes, the losses step by step and the final weights equal to an uninterrupted run's, and status and goodput tell
one account of the two starts. A resume at another world size is refused in one line naming DeepSpeed's universal
checkpoint conversion (exit 2); a resume with another seed (the data drawn in another order) fails the comparison."""

from __future__ import annotations

from pathlib import Path

import ctrl_c_runs
import pytest
from test_accelerate_loop import STEPS, losses, resumed_exactly

from conftest import REPO, hpcjobs
from trainers.integrations import deepspeed_loop, marks

pytest.importorskip("deepspeed")
SCRIPT = REPO / "trainers" / "examples" / "deepspeed_script.py"
PER_EPOCH = 10


def command(tmp_path: Path, name: str, zero: int, *extra: str, ranks: int = 2) -> list[str]:
    return ["submit", "--profile", "local", "--gpus", str(ranks), *extra, *ctrl_c_runs.CHECKS, str(SCRIPT),
            "--out", str(tmp_path / name), "--zero", str(zero), "--sample_seconds", "0.01"]


def run_of(tmp_path: Path, name: str) -> Path:
    """The run folder `submit` made for the command with `--out NAME` (found by the output it recorded)."""
    found = [p.parent for p in (tmp_path / "runs").glob("*/spec.json") if str(tmp_path / name) in p.read_text()]
    assert len(found) == 1, found
    return found[0]


def complete(run: Path) -> list[int]:
    return [n for n, p in marks.checkpoints(run / "checkpoints" / deepspeed_loop.FOLDER)
            if (p / marks.COMPLETE).is_file()]


def stopped(tmp_path: Path, zero: int) -> tuple[str, Path, int]:
    """The command run and stopped by one Ctrl-C after 12 steps: what it printed, its run folder, the saved step."""
    first = ctrl_c_runs.interrupt(command(tmp_path, "out", zero), tmp_path, losses, 12)
    run = run_of(tmp_path, "out")
    done = complete(run)
    assert len(done) == 1 and 12 <= done[0] < STEPS and done[0] % PER_EPOCH, first[-3000:]  # mid-epoch
    assert done[0] % ctrl_c_runs.EVERY == 1 and max(losses(first)) == done[0]  # the agreed step, on every rank
    assert "AFTER LOOP" not in first and not (tmp_path / "out" / "after-loop.txt").exists()
    shards = sorted(p.name for p in (run / "checkpoints" / deepspeed_loop.FOLDER / f"checkpoint-{done[0]}").iterdir()
                    if "optim_states" in p.name)
    assert [s.split("_")[3] for s in shards] == ["0", "1"], shards  # DeepSpeed's own ZeRO shards, one a rank
    return first, run, done[0]


@pytest.fixture(scope="module", params=[2, pytest.param(3, marks=pytest.mark.slow)], ids=["zero2", "zero3"])
def twin(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path, dict[int, str]]:
    """The uninterrupted run at that ZeRO stage every interrupted one is compared with. ZeRO-3 with `-m slow`: CI
    runs this loop's ZeRO-2 case and the Trainer's ZeRO-3 case (tests/test_deepspeed.py), to keep CI near an hour."""
    zero, folder = int(request.param), tmp_path_factory.mktemp(f"zero{request.param}")
    done = hpcjobs(*command(folder, "twin", zero), cwd=folder, timeout=600)
    assert done.returncode == 0 and "AFTER LOOP" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(losses(done.stdout)) == list(range(1, STEPS + 1))
    assert not complete(run_of(folder, "twin"))  # no stop: no save
    return zero, folder / "twin", losses(done.stdout)


@pytest.mark.train
def test_ctrl_c_saves_and_the_same_command_resumes_exactly(tmp_path: Path,
                                                           twin: tuple[int, Path, dict[int, str]]) -> None:
    first, run, stop = stopped(tmp_path, twin[0])
    again = hpcjobs(*command(tmp_path, "out", twin[0]), cwd=tmp_path, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"resuming from {run / 'checkpoints' / deepspeed_loop.FOLDER / f'checkpoint-{stop}'}" in again.stdout
    assert resumed_exactly(first, again.stdout, tmp_path / "out", twin[1:]) == []
    assert (tmp_path / "out" / "after-loop.txt").read_text() == "ran\n"  # once, after the training that finished
    ctrl_c_runs.one_account(run, STEPS, losses=False)


@pytest.mark.train
@pytest.mark.parametrize("twin", [2], indirect=True, ids=["zero2"])
def test_another_world_size_is_refused_and_another_seed_fails_the_comparison(
        tmp_path: Path, twin: tuple[int, Path, dict[int, str]]) -> None:
    """ZeRO-2 only. The stopped run resumed at 1 rank: one line, exit 2, nothing trained. Resumed at 2 ranks with
    another seed (the DistributedSampler's order): the negative control, the comparison above fails."""
    first, run, stop = stopped(tmp_path, 2)
    refused = hpcjobs(*command(tmp_path, "out", 2, "--run-dir", str(run), ranks=1), cwd=tmp_path, timeout=600)
    said = [line for line in refused.stdout.splitlines() + refused.stderr.splitlines() if "universal" in line]
    assert refused.returncode == 2 and len(said) == 1, refused.stdout[-3000:] + refused.stderr[-3000:]
    assert "2 ranks" in said[0] and "1 rank;" in said[0] and "ds_to_universal" in said[0] and "HINT:" in said[0]
    assert not losses(refused.stdout)
    other = [*command(tmp_path, "out", 2, "--run-dir", str(run)), "--seed", "1"]
    again = hpcjobs(*other, cwd=tmp_path, timeout=600)
    assert again.returncode == 0 and f"checkpoint-{stop}" in again.stdout, again.stdout[-3000:]
    assert "loss of step" in " ".join(resumed_exactly(first, again.stdout, tmp_path / "out", twin[1:]))


def test_a_dataloader_is_skipped_into_by_index_with_the_batches_it_would_have_given() -> None:
    """The sampler draws its order from the global RNG as the loader would; the skipped batches' samples are never
    read."""
    import torch
    from torch.utils.data import DataLoader

    read: list[int] = []

    class Seen(torch.utils.data.Dataset[int]):
        def __len__(self) -> int:
            return 12

        def __getitem__(self, i: int) -> int:
            read.append(i)
            return i

    loader = DataLoader(Seen(), batch_size=2, shuffle=True)
    torch.manual_seed(5)
    whole = [b.tolist() for b in loader][2:]
    read.clear()
    torch.manual_seed(5)
    assert [b.tolist() for b in deepspeed_loop.skip_batches(loader, 2)] == whole and len(read) == 8
