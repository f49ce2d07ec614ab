"""--replicate-degree (hybrid sharding: shard within a group of ranks, a node on 2 × 8 GPUs; replicate across) and
--no-reshard-after-forward on 4 CPU ranks (gloo) as a 2 × 2 mesh: a killed run resumes bit-exactly, and its
checkpoint loads exactly on 2 ranks of plain FSDP with --reshard; the flags are refused with ddp before the queue."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from test_reshard import ARGS, probe

from conftest import REPO, hpcjobs, newest_log
from hpcjobs.protocol.settings.trainflags import ConfigError, check_world, parse_trainer_args
from trainers import checkpoint
from trainers.checkpoint.dcp_files import model_weights

# Synchronous saves: the run killed after step 5 must have committed its step-3 checkpoint (a background save under
# a loaded machine was still writing when the kill came, and the resume started at step 0).
HYBRID = ("--strategy", "fsdp", "--replicate-degree", "2", "--no-reshard-after-forward", "--no-async-save")


def start(run: Path, ranks: int, *extra: str, fault: str = "") -> int:
    manual = ("--max-recoveries", "0") if fault else ()  # the kill ends the run; the next command resumes it
    out = hpcjobs("submit", "--profile", "local", "--gpus", str(ranks), "--run-dir", str(run), *manual, *ARGS, *extra,
                  cwd=REPO, env={"HPCJOBS_FAULT_INJECT": fault}, timeout=300)
    return out.returncode


def test_the_layout_flags_are_refused_with_ddp_in_one_line() -> None:
    for flags in (["--replicate-degree", "2"], ["--no-reshard-after-forward"]):
        with pytest.raises(ConfigError) as e:
            parse_trainer_args(flags)
        said = str(e.value)
        assert said.startswith(f"{' '.join(flags)} with --strategy ddp; valid:") and "HINT:" in said, said
    cfg, _ = parse_trainer_args([*HYBRID])
    assert (cfg.replicate_degree, cfg.reshard_after_forward) == (2, False)


@pytest.mark.train
def test_hybrid_sharding_on_a_2x2_mesh_resumes_exactly_and_reshards_to_2_ranks(tmp_path: Path) -> None:
    straight, run = tmp_path / "straight", tmp_path / "run"
    assert start(straight, 4, *HYBRID) == 0
    assert "hybrid sharding: 2 replicas × 2 shards, gathered blocks kept from forward to backward" in \
        newest_log(straight)
    assert start(run, 4, *HYBRID, fault="step@5") != 0  # killed after step 5: its newest checkpoint is step 3
    copy = tmp_path / "copy" / "run"
    shutil.copytree(run, copy)
    assert start(run, 4, *HYBRID) == 0
    assert "resumed from" in newest_log(run)
    ref_a, ref_b = checkpoint.latest(straight / "checkpoints"), checkpoint.latest(run / "checkpoints")
    assert ref_a is not None and ref_b is not None and ref_a.step == ref_b.step == 6
    a, b = model_weights(ref_a), model_weights(ref_b)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    got = probe(copy, 2, "--strategy", "fsdp", "--steps", "6", "--reshard")  # the step-3 checkpoint, on 2 ranks
    assert got["unequal"] == [] and got["counts"][0] == got["counts"][1] > 10 and got["position"][0] == 3
    # A degree that does not divide the ranks: refused before anything starts (the submit side knows the ranks)...
    bad = start(tmp_path / "odd", 4, "--strategy", "fsdp", "--replicate-degree", "3")
    assert bad == 2 and not (tmp_path / "odd").exists()
    # ...and by the ranks' mesh, where a launcher other than hpcjobs started them (torchrun)
    cfg, _ = parse_trainer_args(["--strategy", "fsdp", "--replicate-degree", "3"])
    with pytest.raises(ConfigError, match=r"--replicate-degree 3 with 4 rank\(s\); valid: a divisor of 4 below it"):
        check_world(cfg, 4)
