"""The shared trainer's sharded checkpoints (trainers.checkpoint.sharded) in one process: a foreground and a background
save load back exactly; the background one copies parameters only before the next update; a crafted `.metadata` is
refused without running its code; a checkpoint of another model is refused as such, not moved aside as corrupt."""

from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from hpcjobs.protocol.settings.trainflags import ResumeError
from trainers import checkpoint
from trainers.checkpoint.dcp_files import flat, model_weights
from trainers.checkpoint.sharded import Checkpointer
from trainers.checkpoint.state import RngState
from trainers.checkpoint.stateful import ModelState, OptimizerState, Place, Stateful, gather
from trainers.dist import DistContext
from trainers.distenv import DistEnv


def context() -> DistContext:
    env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, master_addr="127.0.0.1", master_port=1,
                  job_id="0", restart=0, source="single")
    return DistContext(env, torch.device("cpu"), "gloo")


def trained(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(16, 4)).sum().backward()
    opt.step()
    return model, opt


def states(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Stateful]:
    return {"model": ModelState(model), "optimizer": OptimizerState(model, opt), "rng": RngState(torch.device("cpu"))}


def template(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The live tensors of a model and its optimizer, by part name: what a load fills in place."""
    return gather(states(model, opt)).tensors


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("background", [False, True])
def test_a_save_loads_back_exactly(background: bool, tmp_path: Path) -> None:
    model, opt = trained()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    want_all = {k: v.clone() for k, v in flat(template(model, opt))}
    want_rng = torch.get_rng_state()
    ckpt = Checkpointer(tmp_path, context(), keep=2, states=states(model, opt))
    ckpt.save(1, {}, background)
    if background:  # what the trainer does next: a forward and backward, then the update waits for the copy
        model(torch.randn(16, 4)).sum().backward()  # changes BatchNorm's running statistics: copied at once
        ckpt.before_update()
        opt.step()
        ckpt.wait()
    ref = checkpoint.latest(tmp_path)
    assert ref is not None and ref.step == 1 and (ref.path / ".metadata").is_file()
    assert same(model_weights(ref), want)  # the saved state is the one of save(), not of after the update
    fresh, fresh_opt = trained(seed=1)
    loader = Checkpointer(tmp_path, context(), keep=2, states=states(fresh, fresh_opt))
    assert loader.names(Place.SHARED) == ("optimizer_groups",) and loader.names(Place.OWN) == ("rng",)
    shared, own = checkpoint.read_states(ref, 0, loader.names(Place.SHARED), loader.names(Place.OWN))
    loader.load(ref, shared, own)
    assert same(fresh.state_dict(), want)
    assert same(dict(flat(template(fresh, fresh_opt))), want_all)  # the optimizer's moments and steps too
    assert torch.equal(torch.get_rng_state(), want_rng)  # the OWN part, from rank-0.pt


def _replica(rank: int, world: int, store: str, root: str, background: bool) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    ctx = DistContext(DistEnv(rank, rank, world, world, "localhost", 0, "test", 0, "single"), torch.device("cpu"),
                      "gloo", dist.new_group(backend="gloo"), dist.new_group(backend="gloo"))
    model, opt = trained()  # the same on every rank, as DDP's replicas are
    want = {k: v.clone() for k, v in flat(template(model, opt))}
    ckpt = Checkpointer(Path(root), ctx, keep=2, states=states(model, opt))
    ckpt.save(1, {}, background)
    ckpt.before_update()
    ckpt.wait()
    ctx.barrier()  # a background save is committed by rank 0 alone, once every rank has written
    fresh, fresh_opt = trained(seed=1)
    state = template(fresh, fresh_opt)
    ckpt.read_tensors(checkpoint.latest(Path(root)), state)  # type: ignore[arg-type]
    got = dict(flat(state))
    torch.save({"staged": {k: b.nbytes for k, b in ckpt.buffers.items()}, "loaded": same(got, want),
                "total": sum(t.nbytes for t in want.values())}, f"{root}-{rank}")
    dist.destroy_process_group()


@pytest.mark.train
@pytest.mark.parametrize("background", [False, True])
def test_a_tensor_every_rank_holds_is_copied_and_written_by_one_rank(background: bool, tmp_path: Path) -> None:
    """DDP's replicas at 4 ranks: a background save's host copies on each rank hold only what that rank writes (each
    tensor on exactly one rank, the bytes spread), and every rank loads the whole state back; a rank may write
    nothing of the optimizer, or nothing at all, and the checkpoint still holds everything."""
    world, root = 4, str(tmp_path / "ck")
    mp.spawn(_replica, args=(world, str(tmp_path / "store"), root, background), nprocs=world)
    got = [torch.load(f"{root}-{rank}") for rank in range(world)]
    assert all(g["loaded"] for g in got)
    if background:
        staged = [g["staged"] for g in got]
        keys = [k for s in staged for k in s]
        assert len(keys) == len(set(keys)) == len(flat(template(*trained())))  # each tensor copied on one rank
        assert sum(sum(s.values()) for s in staged) == got[0]["total"]
        assert max(sum(s.values()) for s in staged) < got[0]["total"] / 2


class Payload:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {Payload.marker}",)

    marker = ""


def test_a_crafted_metadata_is_refused_and_never_run(tmp_path: Path) -> None:
    model, opt = trained()
    ckpt = Checkpointer(tmp_path / "ck", context(), keep=2, states=states(model, opt))
    ckpt.save(1, {}, background=False)
    ref = checkpoint.latest(tmp_path / "ck")
    assert ref is not None
    Payload.marker = str(tmp_path / "ran")
    (ref.path / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(checkpoint.CorruptCheckpoint, match="posix.system is not allowed|os.system is not allowed"):
        ckpt.read_tensors(ref, template(model, opt))
    with pytest.raises(checkpoint.CorruptCheckpoint):
        model_weights(ref)
    assert not (tmp_path / "ran").exists()


def test_a_checkpoint_of_another_model_is_refused_with_the_difference(tmp_path: Path) -> None:
    model, opt = trained()
    ckpt = Checkpointer(tmp_path, context(), keep=2, states=states(model, opt))
    ckpt.save(1, {}, background=False)
    ref = checkpoint.latest(tmp_path)
    assert ref is not None
    wider = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    other = torch.optim.AdamW(wider.parameters(), lr=0.1)
    with pytest.raises(ResumeError, match=r"model.2.weight is \(2, 8\) there, \(3, 8\) here"):
        ckpt.read_tensors(ref, template(wider, other))


def test_checkpoint_files_carry_no_crc32_and_overlapping_saves_restore_the_setting(tmp_path: Path) -> None:
    """The CRC32 costs more than the write and nothing reads it; the setting is process-wide, and the background
    writer and the training thread may save at once: only the last one out restores the user's value."""
    from torch.utils.serialization import config

    ref = checkpoint.save_checkpoint(tmp_path / "ckpt", 1, {"w": torch.arange(1000.0)}, {"rng": 1})
    with zipfile.ZipFile(ref / checkpoint.SHARED) as z:
        assert {i.CRC for i in z.infolist() if i.file_size} == {0}
    assert config.save.compute_crc32 is True
    background, training = checkpoint.no_crc32(), checkpoint.no_crc32()
    background.__enter__()
    training.__enter__()
    background.__exit__(None, None, None)
    assert config.save.compute_crc32 is False  # the training thread is still writing
    training.__exit__(None, None, None)
    assert config.save.compute_crc32 is True


def test_a_save_that_waits_for_the_one_before_says_so_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """On an H200 a 1b state (14.6 GB) took ~13 s to write and saves came every 5.6 s: each background save then held
    the loop ~9.6 s, waiting for the one before, with nothing said. Now the wait is in saves.jsonl (waited_s) and
    the log says it once, with the interval that would not wait."""
    model, opt = trained()
    ckpt = Checkpointer(tmp_path, context(), keep=3, states=states(model, opt))
    slow = Checkpointer.write

    def write(self: Checkpointer, *args: Any) -> None:
        import time

        time.sleep(1.5)
        slow(self, *args)

    monkeypatch.setattr(Checkpointer, "write", write)
    for step in (10, 20, 30):
        ckpt.save(step, {}, background=True)
        ckpt.before_update()
    ckpt.wait()
    said = [line for line in capsys.readouterr().err.splitlines() if "waited" in line]
    assert len(said) == 1, said
    assert said[0].startswith("hpcjobs: checkpoint step-20 waited 1.") and "for step-10 to be written" in said[0]
    assert "HINT: --ckpt-every " in said[0] and ckpt.waited_s > 1.0


def test_the_wait_advice_asks_for_twice_a_saves_write() -> None:
    from trainers.checkpoint.saves import wait_advice

    line = wait_advice(40, 20, gap_s=5.6, waited_s=8.4)  # a save takes 14 s to write; a step 0.28 s
    assert "~14.0 s a save here, saves every 20 steps, ~5.6 s" in line and "--ckpt-every 100 or more" in line


def test_the_host_buffers_are_allocated_before_the_first_background_save(tmp_path: Path) -> None:
    """Issue 28: the first background save allocated every host buffer (pinned on GPUs: 7.6 s for 1b on an H200)
    while the optimizer step waited. The trainer reserves them after its first step; the save then only copies."""
    model, opt = trained()
    ckpt = Checkpointer(tmp_path, context(), keep=2, states=states(model, opt))
    ckpt.reserve_in_background()
    assert ckpt.reserving is not None
    ckpt.reserving.join()
    reserved = dict(ckpt.buffers)
    assert reserved and {k for k, _ in flat(template(model, opt))} <= {k.lstrip(".") for k in reserved}, reserved
    want = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt.save(1, {}, background=True)
    ckpt.before_update()
    ckpt.wait()
    assert ckpt.buffers.keys() == reserved.keys()
    assert all(ckpt.buffers[k] is reserved[k] for k in reserved)  # the save filled them, allocated none
    ref = checkpoint.latest(tmp_path)
    assert ref is not None and same(model_weights(ref), want)


def test_the_manager_owns_the_periodic_interval(tmp_path: Path) -> None:
    """Issue 36 item 6: the checkpoint interval is the manager's (torchtitan's should_save): every `every` steps,
    never at the last step (the end's own save), none with every=0."""
    model, opt = trained()
    ckpt = Checkpointer(tmp_path / "ck", context(), keep=2, states=states(model, opt), every=5, last_step=12)
    assert [s for s in range(1, 13) if ckpt.should_save(s)] == [5, 10]
    assert not any(Checkpointer(tmp_path / "c2", context(), 2, states(model, opt)).should_save(s) for s in range(9))
    assert [s for s in range(1, 11) if Checkpointer(tmp_path / "c3", context(), 2, states(model, opt), every=5,
                                                    last_step=10).should_save(s)] == [5]
