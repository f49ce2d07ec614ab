"""The integrations' stop checks at a cadence (trainers/integrations/checks.py, issue 25): the Hugging Face Trainer's,
Lightning's and the accelerate loop's step ends agree on a stop at every step end over a start's first 12, then
about once a second of training (the shared trainer's Cadence), not at every step; a stop asked in between is taken
at the next check. One process, a fake clock of 15 ms steps (the HF Trainer's on 2 CPU ranks, bench/hf_trainer.py)."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch.multiprocessing as mp
import yaml

from conftest import REPO, hpcjobs
from trainers import agreement, preemption
from trainers.integrations import CHECK_EVERY, check_every, install, marks
from trainers.integrations.checks import StepEndGuard
from trainers.integrations.signals import joined

STEP_S = 0.015
EVERY = 67  # ceil(1 s / 15 ms): the checks' spacing once the slowest rank's step time is measured
MEASURED = list(range(1, 13))  # every step end over the first 12, while the step time is measured


class Steps:
    """A clock that moves STEP_S a step end, and every agreement made: (step end, which Agreement method)."""

    def __init__(self) -> None:
        self.now, self.step, self.checks = 0.0, 0, []

    def tick(self) -> int:
        self.now += STEP_S
        self.step += 1
        return self.step


@pytest.fixture
def steps(monkeypatch: pytest.MonkeyPatch) -> Iterator[Steps]:
    at = Steps()
    monkeypatch.setattr(agreement.Cadence, "_now", staticmethod(lambda: at.now))
    for how in ("any_rank", "any_rank_pipelined"):
        real: Callable[..., bool] = getattr(agreement.Agreement, how)

        def counted(self: agreement.Agreement, local: bool, how: str = how, real: Callable[..., bool] = real) -> bool:
            at.checks.append((at.step, how))
            return real(self, local)

        monkeypatch.setattr(agreement.Agreement, how, counted)
    monkeypatch.delenv(CHECK_EVERY, raising=False)
    saved = {n: signal.getsignal(n) for n in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)}
    yield at
    preemption.reset()
    for n, handler in saved.items():
        signal.signal(n, handler)


def hf(tmp_path: Path) -> tuple[Any, Callable[[int], bool]]:
    """The HF Trainer's callback and one step end of it: whether it stopped training there."""
    from trainers.integrations import hf_trainer

    callback = hf_trainer.stop_callback()

    def step_end(step: int) -> bool:
        control = SimpleNamespace(should_save=False, should_training_stop=False, should_evaluate=False)
        callback.on_step_end(SimpleNamespace(output_dir=str(tmp_path)), SimpleNamespace(global_step=step), control)
        return control.should_training_stop

    return callback, step_end


def lightning(tmp_path: Path) -> tuple[Any, Callable[[int], bool]]:
    from trainers.integrations import lightning

    callback = lightning.stop_callback("lightning.pytorch")

    def step_end(step: int) -> bool:
        callback.on_train_batch_end(SimpleNamespace(global_step=step))
        return bool(callback.asked)

    return callback, step_end


def accelerate(tmp_path: Path) -> tuple[Any, Callable[[int], bool]]:
    from trainers.integrations import accelerate_loop

    loop = accelerate_loop.Loop(SimpleNamespace(sync_gradients=False), [], 1, None, 0, None, tmp_path)  # never saves

    def step_end(step: int) -> bool:
        loop.step_end(step, (0, step))
        return loop.asked

    return loop, step_end


@pytest.mark.parametrize("integration", [hf, lightning, accelerate])
def test_the_ranks_agree_at_the_cadences_steps_not_at_every_step(
        tmp_path: Path, steps: Steps, integration: Callable[[Path], tuple[Any, Callable[[int], bool]]]) -> None:
    """300 step ends of 15 ms: 16 agreements (the first 12, then every 67th), not 300 (issue 25: one all-reduce a
    step, where the shared trainer checks about once a second). Each in the background (its answer read at the next
    step end)."""
    owner, step_end = integration(tmp_path)
    with joined(owner):
        assert not any(step_end(steps.tick()) for _ in range(300))
    assert [s for s, _ in steps.checks] == MEASURED + [EVERY, 2 * EVERY, 3 * EVERY, 4 * EVERY]
    assert {how for _, how in steps.checks} == {"any_rank_pipelined"}


def test_a_stop_asked_between_checks_is_taken_at_the_next_one(tmp_path: Path, steps: Steps) -> None:
    """Asked at step end 100: taken at 134, the next check, under a second of training later (one rank has its
    answer at once; with more, at the step end after the check: two_ranks below), and that step is saved (the
    Trainer's own save, with hpcjobs's pending mark first)."""
    callback, step_end = hf(tmp_path)
    with pytest.raises(SystemExit), joined(callback):
        assert not any(step_end(steps.tick()) for _ in range(99))
        preemption.request_stop(signal.SIGINT)  # as Ctrl-C would, during step 100
        stopped = next((s for s in (steps.tick() for _ in range(300)) if step_end(s)), None)
        raise SystemExit(0)  # what the Trainer's save of that step ends in (on_save: requeue_and_exit)
    assert stopped == 2 * EVERY and (stopped - 100) * STEP_S < 1.0
    assert callback.stop_step == stopped and (tmp_path / f"checkpoint-{stopped}" / marks.PENDING).exists()


def test_a_set_spacing_checks_every_that_many_step_ends(tmp_path: Path, steps: Steps,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CHECK_EVERY, "5")
    owner, step_end = accelerate(tmp_path)
    with joined(owner):
        for _ in range(30):
            step_end(steps.tick())
    assert steps.checks == [(s, "any_rank_pipelined") for s in range(5, 31, 5)]


def _two_ranks(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist

    from hpcjobs.protocol.contract import LaunchContract

    # "cuda:gloo": no CPU backend on the default group, as under NCCL; the step time's reduce must use the flag's group
    dist.init_process_group("cuda:gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    clock = [0.0]
    agreement.Cadence._now = staticmethod(lambda: clock[0])  # type: ignore[method-assign]
    guard, stopped = StepEndGuard(contract=LaunchContract(run_dir="")), None
    for step in range(1, 200):
        clock[0] += STEP_S * (rank + 1)  # rank 1 is the slower: 30 ms a step
        if rank == 1 and step == 50:
            preemption.request_stop(signal.SIGTERM)
        if guard.step_ended():
            stopped = step
            break
    guard.close()
    Path(f"{out}-{rank}").write_text(repr((stopped, guard.cadence.every)))
    dist.destroy_process_group()


def test_two_ranks_take_the_slowest_ranks_cadence_and_stop_at_the_same_step(tmp_path: Path) -> None:
    """Rank 1 steps in 30 ms, rank 0 in 15: both check every 34 step ends (1 s of the slower's steps); a stop asked
    on rank 1 at step 50 ends both at 69, the step end after the next check (68), whose reduce ran during step 69.
    Over the CPU group the stop flag uses, also when the default group has no CPU backend."""
    out = str(tmp_path / "stopped")
    mp.spawn(_two_ranks, args=(str(tmp_path / "store"), out), nprocs=2)
    assert [Path(f"{out}-{r}").read_text() for r in (0, 1)] == ["(69, 34)", "(69, 34)"]


@pytest.mark.parametrize("bad", ["x", "-1", "1.5", "٣"])
def test_a_bad_spacing_is_refused_in_one_line_before_the_script_runs(bad: str,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert check_every({}) == 0 and check_every({CHECK_EVERY: " 7 "}) == 7
    with pytest.raises(SystemExit) as e:
        install({CHECK_EVERY: bad})
    said = capsys.readouterr().out.strip().splitlines()
    assert e.value.code == 2 and len(said) == 1 and CHECK_EVERY in said[0] and "HINT:" in said[0]


@pytest.mark.parametrize("where", ["--env", "profile"])
def test_submit_refuses_a_bad_spacing_before_anything_is_written(where: str, tmp_path: Path) -> None:
    """Every rank would refuse it at its start: `hpcjobs submit` says so first, in one line, and queues and writes
    nothing, whether --env or the profile's env gave it."""
    profile = yaml.safe_load((REPO / "cluster_profiles" / "local.yaml").read_text())
    flags = ["--profile", "local", f"--env={CHECK_EVERY}=often"]
    if where == "profile":
        profile.setdefault("env", {})[CHECK_EVERY] = "often"
        (tmp_path / "p.yaml").write_text(yaml.safe_dump(profile))
        flags = ["--profile", str(tmp_path / "p.yaml")]
    run = tmp_path / "run"
    out = hpcjobs("submit", *flags, "--gpus", "1", "--run-dir", str(run), "trainers.tasks.lm", "--steps", "3",
                  cwd=REPO, env={"HPCJOBS_HOME": str(tmp_path / "home")})
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert f"{CHECK_EVERY}='often': valid: a whole number" in out.stderr and "HINT:" in out.stderr, out.stderr
    assert not run.exists() and not (tmp_path / "home").exists()
