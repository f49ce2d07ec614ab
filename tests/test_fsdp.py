"""--strategy fsdp's options on CPU (gloo): activation checkpointing changes memory, not results; --compile falls back
to eager with one line where the compiler is missing; options a rank cannot honour are refused in one line."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from conftest import REPO, hpcjobs
from trainers import checkpoint, strategy
from trainers.checkpointer import model_weights

ARGS = ["trainers.tasks.lm", "--size", "tiny", "--dropout", "0.1", "--steps", "6", "--log-every", "2",
        "--ckpt-every", "3", "--batch-size", "4", "--grad-accum", "2", "--seed", "5"]


def train(run: Path, *extra: str, env: dict[str, str] | None = None) -> str:
    out = hpcjobs("submit", "--profile", "local", "--gpus", "2", "--run-dir", str(run), *ARGS, "--strategy", "fsdp",
                  *extra, cwd=REPO, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return (run / "logs" / "restart-0" / "rank-0.log").read_text()


def weights(run: Path) -> dict[str, torch.Tensor]:
    ref = checkpoint.latest(run / "checkpoints")
    assert ref is not None and ref.step == 6
    return model_weights(ref)


def test_activation_checkpointing_gives_the_same_weights_and_compile_falls_back(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    train(plain)
    log = train(tmp_path / "ac", "--activation-checkpointing", "--compile", env={"CXX": "/nonexistent/g++"})
    assert "2 rank(s), fsdp," in log and "activation checkpointing" in log
    assert "--compile: no C++ compiler '/nonexistent/g++' on PATH" in log and "running eager" in log
    a, b = weights(plain), weights(tmp_path / "ac")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # recomputed, dropout masks replayed


def test_cpu_offload_on_a_cpu_rank_is_refused_in_one_line(tmp_path: Path) -> None:
    out = hpcjobs("submit", "--profile", "local", "--gpus", "1", "--run-dir", str(tmp_path / "run"), *ARGS,
                  "--strategy", "fsdp", "--cpu-offload", cwd=REPO, timeout=300)
    assert out.returncode == 2
    log = (tmp_path / "run" / "logs" / "restart-0" / "rank-0.log").read_text()
    said = [line for line in log.splitlines() if line.startswith("hpcjobs: --cpu-offload")]
    assert len(said) == 1 and "valid: --cpu-offload on GPU ranks" in said[0] and "HINT:" in said[0], log


def test_the_default_units_are_the_blocks_and_activation_checkpointing_wraps_each_once() -> None:
    from trainers.tasks.lm import make_task

    model = make_task(["--size", "small"]).model()
    assert [id(u) for u in strategy.units(model)] == [id(b) for b in model.blocks]  # type: ignore[union-attr]
    assert strategy.checkpoint_activations(model) == len(model.blocks)  # type: ignore[arg-type]
    flat = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 2))
    assert strategy.units(flat) == [flat[0], flat[2]]  # its own entries that hold parameters
