"""Selective activation checkpointing beside full (issue 28): --ac-mode selective keeps the matmuls' and attention's
outputs and recomputes the rest, --ac-every N checkpoints every N-th block; both give weights bit-identical to no
checkpointing (CPU ranks, gloo, FSDP), and a mode or a period without --activation-checkpointing is refused in one
line by the parser the submit side shares."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_fsdp import train, weights
from torch.utils._python_dispatch import TorchDispatchMode

from hpcjobs.protocol.settings.trainflags import ConfigError, parse_trainer_args
from trainers import strategy


class CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.matmuls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
            self.matmuls += 1
        return func(*args, **(kwargs or {}))


def matmuls_in_a_step(mode: str | None, every: int = 1) -> tuple[int, int]:
    """(aten matmuls in one forward and backward of the small LM, blocks checkpointed)."""
    from trainers.tasks.lm import make_task

    torch.manual_seed(0)
    task = make_task(["--size", "tiny"])
    model = task.model()
    wrapped = strategy.checkpoint_activations(model, mode, every) if mode else 0
    batch = next(iter(torch.utils.data.DataLoader(task.train_data(), batch_size=2)))
    with CountMatmuls() as counted:
        task.loss(model, batch).backward()
    return counted.matmuls, wrapped


def test_selective_checkpointing_recomputes_no_matmul_and_full_recomputes_each_blocks() -> None:
    none, _ = matmuls_in_a_step(None)
    full, blocks = matmuls_in_a_step("full")
    selective, wrapped = matmuls_in_a_step("selective")
    assert wrapped == blocks > 1
    assert selective == none < full  # full runs every block's forward matmuls again in the backward
    half, some = matmuls_in_a_step("full", every=2)
    assert some == (blocks + 1) // 2 and none < half < full


def test_a_mode_or_a_period_without_activation_checkpointing_is_refused_in_one_line() -> None:
    for flags in (["--ac-mode", "selective"], ["--ac-every", "2"]):
        with pytest.raises(ConfigError) as e:
            parse_trainer_args(flags)
        said = str(e.value)
        assert said.startswith(f"{' '.join(flags)} without --activation-checkpointing; valid:") and "HINT:" in said
    cfg, _ = parse_trainer_args(["--activation-checkpointing", "--ac-mode", "selective", "--ac-every", "2"])
    assert (cfg.ac_mode, cfg.ac_every, cfg.checkpoints_every_block()) == ("selective", 2, False)
    selective, _ = parse_trainer_args(["--activation-checkpointing", "--ac-mode", "selective"])
    assert selective.checkpoints_every_block()  # the memory plan counts selective checkpointing (issue 41)


@pytest.mark.train
def test_selective_and_every_other_block_checkpointing_give_the_weights_of_none(tmp_path: Path) -> None:
    train(tmp_path / "none")
    log = train(tmp_path / "sel", "--activation-checkpointing", "--ac-mode", "selective")
    assert "activation checkpointing (selective, every block)" in log
    train(tmp_path / "every2", "--activation-checkpointing", "--ac-every", "2")
    a = weights(tmp_path / "none")
    for other in ("sel", "every2"):
        b = weights(tmp_path / other)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), other  # dropout masks replayed
