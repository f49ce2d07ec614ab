"""The shared trainer's sharded checkpoints (trainers.checkpointer) in one process: a foreground and a background save
load back exactly; the background one copies parameters only before the next update; a crafted `.metadata` is
refused without running its code; a checkpoint of another model is refused as such, not moved aside as corrupt."""

from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from trainers import checkpoint
from trainers.checkpointer import Checkpointer, Parts, model_weights, tensors_of
from trainers.config import ResumeError
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


def parts(model: nn.Module, opt: torch.optim.Optimizer) -> Parts:
    return Parts(template(model, opt), {"groups": 1}, {"rng": torch.get_rng_state()},
                 frozenset(name for name, _ in model.named_buffers()))


def template(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return tensors_of(model, opt)[0]


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("background", [False, True])
def test_a_save_loads_back_exactly(background: bool, tmp_path: Path) -> None:
    model, opt = trained()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    ckpt = Checkpointer(tmp_path, context(), keep=2)
    ckpt.save(1, parts(model, opt), {}, background)
    if background:  # what the trainer does next: a forward and backward, then the update waits for the copy
        model(torch.randn(16, 4)).sum().backward()  # changes BatchNorm's running statistics: copied at once
        ckpt.before_update()
        opt.step()
        ckpt.wait()
    ref = checkpoint.latest(tmp_path)
    assert ref is not None and ref.step == 1 and (ref.path / ".metadata").is_file()
    assert same(model_weights(ref), want)  # the saved state is the one of save(), not of after the update
    fresh, fresh_opt = trained(seed=1)
    state = template(fresh, fresh_opt)
    ckpt.load(ref, state)
    assert same(state["model"], want)


class Payload:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {Payload.marker}",)

    marker = ""


def test_a_crafted_metadata_is_refused_and_never_run(tmp_path: Path) -> None:
    model, opt = trained()
    ckpt = Checkpointer(tmp_path / "ck", context(), keep=2)
    ckpt.save(1, parts(model, opt), {}, background=False)
    ref = checkpoint.latest(tmp_path / "ck")
    assert ref is not None
    Payload.marker = str(tmp_path / "ran")
    (ref.path / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(checkpoint.CorruptCheckpoint, match="posix.system is not allowed|os.system is not allowed"):
        ckpt.load(ref, template(model, opt))
    with pytest.raises(checkpoint.CorruptCheckpoint):
        model_weights(ref)
    assert not (tmp_path / "ran").exists()


def test_a_checkpoint_of_another_model_is_refused_with_the_difference(tmp_path: Path) -> None:
    model, opt = trained()
    ckpt = Checkpointer(tmp_path, context(), keep=2)
    ckpt.save(1, parts(model, opt), {}, background=False)
    ref = checkpoint.latest(tmp_path)
    assert ref is not None
    wider = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    other = torch.optim.AdamW(wider.parameters(), lr=0.1)
    with pytest.raises(ResumeError, match=r"model.2.weight is \(2, 8\) there, \(3, 8\) here"):
        ckpt.load(ref, template(wider, other))


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
