"""The node-local tier's copy overlapped with training and its measured interval (trainers/localtier_copy.py,
trainers/localtier_auto.py; issue 40): the loop does not copy what only the optimizer's step changes (the writer
thread does, into host buffers kept across saves), the optimizer's step waits until it is copied, what a forward
changes is taken at the save; on a GPU (faked here: torch.cuda's streams and events recorded) the copies are queued on
a side stream behind an event of the training stream and the step's stream waits on theirs; `auto` picks the
smallest interval whose measured cost is within 2% of the step time, and a rank killed under `auto` resumes from the
tier bit-identical to an uninterrupted run."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from test_local_tier import ARGS, assert_same, launch, twin  # noqa: F401 - twin: the module's fixture
from torch import nn

from trainers import localtier_auto, localtier_copy
from trainers.checkpoint.state import Position
from trainers.checkpoint.stateful import ModelState, OptimizerState, Stateful
from trainers.localtier import LocalTier, file_name
from trainers.localtier_auto import AutoInterval, every_for
from trainers.localtier_copy import HostCopy
from trainers.localtier_state import decode


def one_rank(tmp_path: Path, every: int | str = 5) -> LocalTier:
    env = SimpleNamespace(job_id="job-overlap", local_world_size=1)
    ctx = SimpleNamespace(rank=0, world_size=1, env=env, device=torch.device("cpu"))
    return LocalTier(every, ctx, tmp_path / "run", 100)  # type: ignore[arg-type]


def model_and_states() -> tuple[nn.Module, torch.optim.Optimizer, dict[str, Stateful]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    train_step(model, opt)
    return model, opt, {"model": ModelState(model), "optimizer": OptimizerState(model, opt), "position": Position()}


def train_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(8, 4)).square().mean().backward()
    opt.step()
    opt.zero_grad()


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[threading.Event, list[str]]]:
    """The writer's copy held until `go` is set; the threads it ran in."""
    go, where = threading.Event(), []
    finish = HostCopy.finish

    def held_finish(self: HostCopy) -> None:
        where.append(threading.current_thread().name)
        assert go.wait(30)
        finish(self)

    monkeypatch.setattr(HostCopy, "finish", held_finish)
    yield go, where
    go.set()


def saved(tier: LocalTier, step: int) -> dict[str, Any]:
    tier.join()
    path = tier.root / file_name(0, 1, step)
    return decode(path.read_bytes())["tensors"]


def test_the_loop_does_not_copy_the_optimizer_step_waits_for_the_copy(tmp_path: Path, held: Any) -> None:
    go, where = held
    model, opt, states = model_and_states()
    tier = one_rank(tmp_path)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tier.save(5, states, dict)
    assert where == [] or where[0].startswith("hpcjobs-local-"), where  # not copied on the training thread
    model(torch.randn(8, 4)).square().mean().backward()  # a forward: the running statistics change now
    stepper = threading.Thread(target=opt.step)
    stepper.start()
    stepper.join(0.3)
    assert stepper.is_alive(), "the optimizer's step went on before the save had copied the weights"
    go.set()
    stepper.join(10)
    assert not stepper.is_alive()
    got = saved(tier, 5)["model"]
    assert all(torch.equal(got[k], before[k]) for k in before), "the file holds the state of step 5"
    assert not torch.equal(model.state_dict()["0.weight"], before["0.weight"])  # the step did change them
    assert not torch.equal(model.state_dict()["1.running_mean"], before["1.running_mean"])
    tier.close()


def test_the_host_buffers_are_kept_from_one_save_to_the_next(tmp_path: Path) -> None:
    model, opt, states = model_and_states()
    tier = one_rank(tmp_path)
    tier.save(5, states, dict)
    tier.join()
    first = {k: b.data_ptr() for k, b in tier.copy.buffers.items()}
    train_step(model, opt)
    tier.save(10, states, dict)
    assert {k: b.data_ptr() for k, b in tier.copy.buffers.items()} == first and first
    assert torch.equal(saved(tier, 10)["model"]["0.weight"], model.state_dict()["0.weight"])
    tier.close()
    assert not tier.copy.hooked


class FakeCuda:
    """torch.cuda's streams and events, recorded: the order of the GPU path's calls, on CPU tensors."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, ...]] = []
        self.pinned: list[bool] = []
        main = self.stream("training")
        monkeypatch.setattr(torch.cuda, "Event", lambda: self.event())
        monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: self.stream("side"))
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)
        monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "set_device", lambda d: self.calls.append(("set_device",)))
        monkeypatch.setattr(localtier_copy, "host_buffer", self.buffer)

    def buffer(self, shape: torch.Size, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        self.pinned.append(pin)
        return torch.empty(shape, dtype=dtype)

    def stream(self, name: str) -> Any:
        calls = self.calls
        return SimpleNamespace(name=name, wait_event=lambda e: calls.append((name, "waits on", e.name)))

    def event(self) -> Any:
        calls, n = self.calls, sum(c[0] == "record" for c in self.calls)
        ev = SimpleNamespace(name=f"event{n}")
        ev.record = lambda s: calls.append(("record", ev.name, s.name))
        ev.synchronize = lambda: calls.append(("host waits on", ev.name))
        return ev


def test_on_a_gpu_the_copy_is_queued_on_a_side_stream_and_the_step_waits_on_its_event(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCuda(monkeypatch)
    model, opt, states = model_and_states()
    copy = HostCopy(torch.device("cuda", 0))
    parts = {"model": dict(model.state_dict()), "optimizer": {"state": {"w": torch.ones(3)}}}
    out = copy.start(parts, {"model": frozenset({"1.running_mean"})}, states)
    assert fake.calls == [("record", "event0", "training")]  # the training stream's point: no host wait
    assert fake.pinned and all(fake.pinned)
    assert torch.equal(out["model"]["1.running_mean"], model.state_dict()["1.running_mean"])  # taken at the save
    assert not copy.queued.is_set() and len(copy.later) == len(parts["model"])  # the rest: the writer's
    writer = threading.Thread(target=copy.finish)
    writer.start()
    writer.join(10)
    assert fake.calls[1:] == [("set_device",), ("side", "waits on", "event0"), ("record", "event1", "side"),
                              ("host waits on", "event1")]
    assert torch.equal(out["optimizer"]["state"]["w"], torch.ones(3))
    copy.hold()  # the optimizer's pre-hook: the training stream waits on the copies' event, the host does not
    assert fake.calls[-1] == ("training", "waits on", "event1")
    calls = len(fake.calls)
    copy.hold()  # the next steps: nothing in flight, nothing to wait for
    assert len(fake.calls) == calls
    assert list(copy.hooked) == [id(opt)]


def test_auto_picks_the_smallest_interval_within_2_percent(monkeypatch: pytest.MonkeyPatch) -> None:
    assert every_for(0.012, 0.0087) == 69  # the classifier's save (~12 ms) and step (8.7 ms), measured before
    assert every_for(0.001, 0.1) == 1 and every_for(1e6, 1e-3) == localtier_auto.MOST
    clock = iter([0.0, 0.010, 0.020, 0.030,  # clean steps of 10 ms
                  0.062, 0.074, 0.084, 0.094])  # the save's step (+22 ms), the writer's (+2 ms), then clean
    monkeypatch.setattr(localtier_auto.time, "monotonic", lambda: next(clock))
    auto = AutoInterval()
    for _ in range(4):
        auto.tick(writing=False)
    assert auto.propose() == (0, 0.0, pytest.approx(0.010))  # no save measured yet: no proposal
    auto.saved()
    auto.tick(writing=True)
    auto.tick(writing=False)
    auto.tick(writing=False)
    auto.tick(writing=False)
    every, cost, step = auto.propose()
    assert cost == pytest.approx(0.024) and step == pytest.approx(0.010) and every == 120


@pytest.mark.train
def test_auto_a_killed_rank_resumes_from_the_tier_bit_identical(tmp_path: Path, twin: Path) -> None:  # noqa: F811
    """Saves at steps 10, 20, 30 (the interval agreed at 20 applied at 30, said once), rank 1 killed after 38."""
    run, shm = tmp_path / "run", tmp_path / "shm"
    codes, out = launch(run, [shm], tier="auto", fault="step@38:1")  # type: ignore[arg-type]
    assert codes[1] == -9 and "local checkpoints every" in out and "--local-ckpt-every auto" in out, out
    codes, out = launch(run, [shm], tier="auto")  # type: ignore[arg-type]
    assert codes == [0, 0], out
    resumed = next(line for line in out.splitlines() if "resumed from step" in line and "(local tier)" in line)
    assert int(resumed.split("resumed from step ")[1].split()[0]) >= 30, out
    assert_same(twin, run)
    assert ARGS[0] == "trainers.tasks.classifier"


def test_auto_whose_copies_do_not_fit_leaves_the_tier_off_in_one_line(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(localtier_auto, "free_room", lambda root: (1000, "/dev/shm (free space)"))
    _, _, states = model_and_states()
    tier = one_rank(tmp_path, "auto")
    due = []
    for step in range(1, 40):
        if tier.due(step):
            due.append(step)
            tier.save(step, states, dict)
    assert due == [10] and tier.every == 0 and not tier.root.exists()
    said = capsys.readouterr().out
    assert said.count("--local-ckpt-every auto: the tier needs") == 1 and "the tier is off" in said, said


def test_the_memory_cgroups_headroom_is_read_v2_and_v1(tmp_path: Path) -> None:
    from trainers.localtier_state import cgroup_headroom

    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "memory.max").write_text("1000\n")
    (tmp_path / "job" / "memory.current").write_text("300\n")
    (tmp_path / "proc").write_text("0::/job\n")
    assert cgroup_headroom(tmp_path / "proc", tmp_path) == 700
    (tmp_path / "job" / "memory.max").write_text("max\n")
    assert cgroup_headroom(tmp_path / "proc", tmp_path) is None
    (tmp_path / "memory" / "slurm").mkdir(parents=True)
    (tmp_path / "memory" / "slurm" / "memory.limit_in_bytes").write_text("5000")
    (tmp_path / "memory" / "slurm" / "memory.usage_in_bytes").write_text("1000")
    (tmp_path / "proc").write_text("4:memory:/slurm\n0::/\n")
    assert cgroup_headroom(tmp_path / "proc", tmp_path) == 4000
