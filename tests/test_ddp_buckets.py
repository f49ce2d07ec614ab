"""trainers/ddp_buckets.py in one run of 4 gloo ranks: a DDP built anew mid-run (as a resumed process builds it)
reduces in another bucket layout than the DDP it replaces and drifts from the uninterrupted run, unless it is built
with the layout rank 0 recorded at the save; and what is read from the run folder is checked before it is used."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from trainers import ddp_buckets

STEPS, CUT = 24, 12


def train(rank: int, port: int, folder: str, cut: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=4)
    for fresh in ("", "recorded", "torch"):
        losses, weights = steps(rank, Path(folder) / "ddp-buckets.json", fresh, cut)
        if rank == 0:
            torch.save((losses, weights), Path(folder) / f"{fresh or 'straight'}.pt")
    dist.destroy_process_group()


def steps(rank: int, layouts: Path, fresh: str, cut: int) -> tuple[list[float], list[torch.Tensor]]:
    """24 steps of a small MLP with dropout and AdamW; `fresh`: '' (one DDP throughout), 'recorded' (a new DDP at step
    12 with the layout recorded at a save before it) or 'torch' (a new DDP at step 12 as torch builds it)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(37, 129), nn.ReLU(), nn.Dropout(0.1), nn.Linear(129, 23), nn.ReLU(),
                          nn.Linear(23, 1))
    torch.manual_seed(100 + rank)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ddp = nn.parallel.DistributedDataParallel(model)
    if fresh == "recorded":
        ddp_buckets._unrecorded[ddp] = (layouts, ddp_buckets.key_of(list(model.parameters())))
    data, losses = torch.Generator().manual_seed(rank), []
    for step in range(STEPS):
        if step == cut and fresh:
            if rank == 0:
                ddp_buckets.record()  # where a save begins
            dist.barrier()
            saved = ddp_buckets.read(layouts) if fresh == "recorded" else {}
            with ddp_buckets.saved_layout_applied(saved, []):
                ddp = nn.parallel.DistributedDataParallel(model)
        x, y = torch.randn(16, 37, generator=data), torch.randn(16, 1, generator=data)
        loss = ((ddp(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.train
@pytest.mark.parametrize("cut", [CUT, 2])
def test_a_ddp_built_anew_with_the_recorded_layout_reduces_as_the_uninterrupted_one(tmp_path: Path, cut: int) -> None:
    """cut 2: a save after the second step, whose forward logged DDP's runtime data before it rebuilt its buckets
    (torch logs, then rebuilds): the layout was missing there and a 2 x 2 cluster job stopped at step 2 drifted."""
    mp.spawn(train, args=(29611 + cut, str(tmp_path), cut), nprocs=4)
    straight, recorded, as_torch_builds_it = (torch.load(tmp_path / f"{n}.pt") for n in ("straight", "recorded",
                                                                                         "torch"))
    assert recorded[0] == straight[0] and all(torch.equal(a, b) for a, b in zip(recorded[1], straight[1], strict=True))
    assert ddp_buckets.read(tmp_path / "ddp-buckets.json")  # rank 0 wrote the layout at the "save"
    # The control: a DDP built anew as torch builds it, what a resumed process did before.
    assert not all(torch.equal(a, b) for a, b in zip(as_torch_builds_it[1], straight[1], strict=True))


def test_a_layout_is_used_only_when_it_is_a_whole_permutation_of_the_parameters(tmp_path: Path) -> None:
    assert ddp_buckets.valid([[3, 2], [1, 0]], 4)
    assert not ddp_buckets.valid([[3, 2], [1]], 4) and not ddp_buckets.valid([[0, 0, 1, 2]], 4)
    assert not ddp_buckets.valid([], 0) and not ddp_buckets.valid("0 1", 2) and not ddp_buckets.valid([["0"]], 1)
    for text in ("", "not json", "[1, 2]", '{"layouts": [1]}'):
        (tmp_path / "ddp-buckets.json").write_text(text)
        assert ddp_buckets.read(tmp_path / "ddp-buckets.json") == {}
    assert ddp_buckets.read(tmp_path / "none.json") == {}
