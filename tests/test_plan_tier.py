"""`hpcjobs plan --model config.json --local-ckpt-every N` (issue 40): the node-local tier's host memory a node, the
figure `submit --dry-run` shows (hpcjobs.protocol.planning.host_plan: ranks a node × 4 copies × the rank's state),
against the profile's mem_per_gpu × the GPUs of a node; a tier that does not fit exits 1, as a plan that does not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import REPO, hpcjobs
from hpcjobs.protocol.planning.host_plan import COPIES, gib, state_bytes
from hpcjobs.request.hf_config import model_shape

MODEL = str(REPO / "tests" / "data" / "hf" / "qwen2.5-7b.json")
FSDP = ("--nodes", "2", "--gpus", "8", "--strategy", "fsdp", "--activation-checkpointing")


def profile(tmp_path: Path, mem: str | None) -> str:
    path = tmp_path / "site.yaml"
    path.write_text("scheduler: slurm\ngpus_per_node: 8\ngpu_memory: 80GB\nmax_nodes: 64\n"
                    + (f"mem_per_gpu: {mem}\n" if mem else ""))
    return str(path)


def per_node() -> int:
    shape, _ = model_shape(MODEL)
    return 8 * COPIES * state_bytes(shape.params, "fsdp", 16)


@pytest.mark.parametrize(("mem", "fits"), [("64G", True), ("16G", False)])
def test_the_tiers_figure_a_node_against_the_profiles_memory(tmp_path: Path, mem: str, fits: bool) -> None:
    out = hpcjobs("plan", "--model", MODEL, "--profile", profile(tmp_path, mem), *FSDP, "--local-ckpt-every", "5")
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("node-local tier: "))
    assert out.returncode == (0 if fits else 1), out
    assert f"--local-ckpt-every 5: 8 ranks × {COPIES} copies" in line and f"= {gib(per_node())} " in line, line
    assert f"(mem_per_gpu {mem} × 8 GPUs of profile site)" in line, line
    assert line.endswith(": fits" if fits else ": does NOT fit"), line
    found = json.loads(hpcjobs("plan", "--model", MODEL, "--profile", profile(tmp_path, mem), *FSDP,
                               "--local-ckpt-every", "5", "--json").stdout)
    tier = found["local_tier"]
    assert tier["per_node"] == per_node() and tier["ranks_per_node"] == 8 and tier["fits"] is fits, tier
    assert found["fits"] is True  # the GPU plan fits either way: the exit code above is the tier's


def test_not_judged_without_the_nodes_memory_and_absent_with_the_tier_off(tmp_path: Path) -> None:
    out = hpcjobs("plan", "--model", MODEL, "--profile", profile(tmp_path, None), *FSDP, "--local-ckpt-every", "5")
    assert out.returncode == 0 and "profile site declares no mem_per_gpu" in out.stdout, out
    out = hpcjobs("plan", "--model", MODEL, *FSDP, "--local-ckpt-every", "5")
    assert out.returncode == 0 and "not checked: no --profile (its mem_per_gpu)" in out.stdout, out
    out = hpcjobs("plan", "--model", MODEL, "--profile", profile(tmp_path, "16G"), *FSDP, "--local-ckpt-every", "0",
                  "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["local_tier"] is None, out


def test_a_bad_interval_is_one_line() -> None:
    out = hpcjobs("plan", "--model", MODEL, "--local-ckpt-every", "-1")
    assert out.returncode == 2 and out.stdout == "" and len(out.stderr.splitlines()) == 1, out
    assert "--local-ckpt-every -1" in out.stderr and "HINT:" in out.stderr, out


def test_auto_shows_the_figure_and_a_tier_that_does_not_fit_is_left_off_not_refused(tmp_path: Path) -> None:
    out = hpcjobs("plan", "--model", MODEL, "--profile", profile(tmp_path, "16G"), *FSDP, "--local-ckpt-every", "auto")
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("node-local tier: "))
    assert out.returncode == 0 and line.startswith("node-local tier: --local-ckpt-every auto: 8 ranks"), out
    assert f"= {gib(per_node())} " in line and line.endswith("does NOT fit: auto leaves the tier off"), line
