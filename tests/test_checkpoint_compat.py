"""Checkpoints written before the trainer handed named parts to the checkpoint manager still resume, exactly.

tests/fixtures/checkpoint-2942bf0/step-2 is step 2 of a run made by main at 2942bf0 (the trainer's own `Parts`
layout, before trainers.checkpoint.stateful), with:

    hpcjobs submit --profile local --gpus 1 --run-dir RUN ARGS   (ARGS below; the step-2 folder copied out)

The same run made by this code writes the same files, keys and values at step 2, and a start resumed from the old
step 2 ends with the same weights, bit for bit, as the run made straight. (Values compare equal only under the torch
that made the fixture, 2.13 on the CPU; the test says so rather than failing on another one. And bit for bit only
on a CPU whose kernels round as the fixture's did: on another, measured on a Xeon VM where torch picks AVX512, 11 of
the 24 tensors at step 2 differed by 1e-12 to 7e-9; there the values and the resumed run's must agree to float
rounding, rtol 1e-5, which a wrong layout (a tensor or state in another's place) is far from.)
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import REPO, hpcjobs
from trainers import checkpoint
from trainers.checkpoint.dcp_files import SafeReader, model_weights, offline_tensors

FIXTURE = Path(__file__).parent / "fixtures" / "checkpoint-2942bf0" / "step-2"
MADE_WITH = "2.13"
ARGS = ["trainers.tasks.classifier", "--features", "4", "--hidden", "8", "--classes", "3", "--samples", "256",
        "--dropout", "0.1", "--noise", "0.1", "--steps", "4", "--log-every", "1", "--ckpt-every", "2",
        "--batch-size", "8", "--grad-accum", "2", "--warmup-steps", "1", "--seed", "7"]


def run(run_dir: Path) -> str:
    out = hpcjobs("submit", "--profile", "local", "--gpus", "1", "--run-dir", str(run_dir), *ARGS, cwd=REPO,
                  env={"HPCJOBS_FAULT_INJECT": ""}, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout + out.stderr


def same(a: Any, b: Any) -> bool:
    """Equal values through dicts, lists and tuples; tensors bit for bit (dtype and shape included)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """The same keys, dtypes and shapes, and values equal to float rounding (another CPU's kernels)."""
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and
                                        torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-7) for k in a)


def small(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)


def test_the_fixture_holds_the_old_layouts_keys() -> None:
    """What the layout was, read from the fixture itself: if this fails, the fixture is not main's old layout."""
    assert sorted(p.name for p in FIXTURE.iterdir()) == [".metadata", "FINISHED", "__0_0.distcp", "meta.json",
                                                        "rank-0.pt", "shared.pt"]
    assert list(small(FIXTURE / "shared.pt")) == ["optimizer_groups", "scheduler", "scaler", "position"]
    assert list(small(FIXTURE / "rank-0.pt")) == ["rng"]
    keys = SafeReader(FIXTURE).read_metadata().state_dict_metadata
    assert {k.split(".")[0] for k in keys} == {"model", "optimizer"} and "model.0.weight" in keys
    assert "optimizer.state.0.weight.exp_avg" in keys


@pytest.mark.train
def test_a_checkpoint_written_by_the_old_layout_resumes_exactly(tmp_path: Path) -> None:
    if not torch.__version__.startswith(MADE_WITH):
        pytest.skip(f"values compare only under torch {MADE_WITH}, the fixture's (this is {torch.__version__})")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run(straight)
    shutil.copytree(FIXTURE, resumed / "checkpoints" / "step-2")
    out = run(resumed)
    assert f"resumed from {resumed / 'checkpoints' / 'step-2'} (step 2" in out
    # This code's step 2 is the old code's: the same files, the same keys, the same values.
    new = straight / "checkpoints" / "step-2"
    assert sorted(p.name for p in new.iterdir()) == sorted(p.name for p in FIXTURE.iterdir())
    for name in ("shared.pt", "rank-0.pt"):
        assert same(small(new / name), small(FIXTURE / name)), name
    mine, old = offline_tensors(new, ""), offline_tensors(FIXTURE, "")
    exact = same(mine, old)  # this CPU rounds as the fixture's did (the module docstring)
    assert exact or close(mine, old)
    # and a start resumed from the old step 2 goes on exactly as the straight run did.
    ends = [checkpoint.latest(run_dir / "checkpoints") for run_dir in (straight, resumed)]
    assert all(ref is not None and ref.step == 4 for ref in ends)
    equal = same if exact else close
    assert equal(model_weights(ends[0]), model_weights(ends[1]))  # type: ignore[arg-type]
    assert equal(offline_tensors(ends[0].path, "optimizer."), offline_tensors(ends[1].path, "optimizer."))  # type: ignore[union-attr]
