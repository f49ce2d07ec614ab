"""The node-local tier's host memory at submit (issue 40 item 1; hpcjobs.protocol.planning.host_plan): counted in the
plan, shown in the dry run, and a tier that does not fit the node's memory refused in one line before anything is
queued."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import REPO, hpcjobs
from hpcjobs.profiles.cluster_profile import ClusterProfile, parse_profile
from hpcjobs.protocol.errors import UsageError
from hpcjobs.protocol.planning.host_plan import COPIES, state_bytes
from hpcjobs.protocol.planning.lmsizes import SIZES, n_params
from hpcjobs.request import gpu_fit
from hpcjobs.request.gpu_fit import check_fits, check_tier, tier_of

LM = "trainers.tasks.lm"


def slurm(mem: str | None = "16G") -> ClusterProfile:
    keys: dict[str, object] = {"gpus_per_node": 8, "gpu_memory": "80GB", "max_nodes": 64}
    return parse_profile({**keys, "mem_per_gpu": mem} if mem else keys, "h100mem", "test")


def test_the_tier_is_four_copies_of_each_ranks_state_a_node() -> None:
    params = n_params(SIZES["1b"])
    ddp = tier_of(LM, ("--size", "1b", "--strategy", "ddp", "--local-ckpt-every", "5"), 16, 8)
    fsdp = tier_of(LM, ("--size", "1b", "--strategy", "fsdp", "--local-ckpt-every", "5"), 16, 8)
    assert ddp is not None and ddp.per_node == 8 * COPIES * 12 * params
    assert fsdp is not None and fsdp.per_node == 8 * COPIES * state_bytes(params, "fsdp", 16) == ddp.per_node // 16
    assert tier_of(LM, ("--size", "1b", "--local-ckpt-every", "0"), 16, 8) is None  # off
    auto = tier_of(LM, ("--size", "1b", "--local-ckpt-every", "auto"), 16, 8)  # the same copies
    assert auto is not None and auto.every == "auto" and auto.per_node == ddp.per_node
    assert tier_of("mypkg.task", ("--local-ckpt-every", "5"), 16, 8) is None  # a user's own model: not known


def test_a_tier_larger_than_the_nodes_memory_is_refused_in_one_line() -> None:
    with pytest.raises(UsageError) as e:  # 1.21B params × 12 B × 4 copies × 8 ranks = 434 GiB > 8 × 16 GiB
        check_fits(slurm(), LM, ("--size", "1b", "--strategy", "ddp", "--local-ckpt-every", "5"), 2, 8, 64)
    line = e.value.one_line()
    assert "\n" not in line and "--local-ckpt-every 5" in line and "valid: at most 128.00 GiB" in line, line
    assert "mem_per_gpu 16G × 8 GPUs" in line and "HINT: --local-ckpt-every 0" in line and "fsdp" in line, line


def test_what_fits_or_is_not_known_is_not_refused() -> None:
    args = ("--size", "1b", "--strategy", "ddp")
    check_fits(slurm(), LM, (*args, "--local-ckpt-every", "0"), 2, 8, 64)  # the tier off
    check_fits(slurm(None), LM, (*args, "--local-ckpt-every", "5"), 2, 8, 64)  # no memory known
    check_fits(slurm(), LM, ("--size", "1b", "--strategy", "fsdp", "--local-ckpt-every", "5"), 2, 8, 64)  # 27 GiB
    check_fits(slurm(), "mypkg.task", (*args, "--local-ckpt-every", "5"), 2, 8, 64)


def profile_file(tmp_path: Path) -> str:
    path = tmp_path / "mem.yaml"
    path.write_text("gpus_per_node: 8\ngpu_memory: 80GB\nmem_per_gpu: 16G\n")
    return str(path)


def test_submit_refuses_before_anything_is_queued(tmp_path: Path) -> None:
    out = hpcjobs("submit", "--profile", profile_file(tmp_path), "--nodes", "2", "--gpus", "8", "--no-snapshot", LM,
                  "--size", "1b", "--strategy", "ddp", "--local-ckpt-every", "5", cwd=REPO)
    assert out.returncode == 2 and out.stdout == "", out
    assert len(out.stderr.strip().splitlines()) == 1 and "HINT: --local-ckpt-every 0" in out.stderr, out.stderr
    assert hpcjobs("list", "--json").stdout.strip() == "[]"


def test_dry_run_shows_the_tiers_host_memory(tmp_path: Path) -> None:
    out = hpcjobs("submit", "--profile", profile_file(tmp_path), "--nodes", "2", "--gpus", "8", "--dry-run",
                  "--no-snapshot", LM, "--size", "1b", "--strategy", "fsdp", "--local-ckpt-every", "5", cwd=REPO)
    assert out.returncode == 0, out.stderr
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("# node-local tier"))
    assert "8 ranks × 4 copies" in line and "of 128.00 GiB (mem_per_gpu 16G × 8 GPUs" in line, line
    assert line.endswith(": fits"), line
    off = hpcjobs("submit", "--profile", profile_file(tmp_path), "--dry-run", "--no-snapshot", LM,
                  "--local-ckpt-every", "0", cwd=REPO)
    assert "# node-local tier" not in off.stdout


def test_auto_that_does_not_fit_is_not_refused_it_leaves_the_tier_off(tmp_path: Path) -> None:
    """`auto` for 1b ddp on 2 × 8 (434 GiB a node, 128 GiB there): submitted, the dry run says the tier stays off;
    an explicit interval of the same job is refused (above)."""
    check_fits(slurm(), LM, ("--size", "1b", "--strategy", "ddp", "--local-ckpt-every", "auto"), 2, 8, 64)
    out = hpcjobs("submit", "--profile", profile_file(tmp_path), "--nodes", "2", "--gpus", "8", "--dry-run",
                  "--no-snapshot", LM, "--size", "1b", "--strategy", "ddp", "--local-ckpt-every", "auto", cwd=REPO)
    assert out.returncode == 0, out.stderr
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("# node-local tier"))
    assert line.startswith("# node-local tier: --local-ckpt-every auto: 8 ranks × 4 copies"), line
    assert line.endswith("does NOT fit: auto leaves the tier off"), line
    fits = tier_of(LM, ("--size", "1b", "--strategy", "fsdp", "--local-ckpt-every", "auto"), 16, 8)
    assert fits is not None and fits.every == "auto"


def test_a_local_tier_is_checked_against_its_folders_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    local = parse_profile({"scheduler": "local", "gpus_per_node": 8}, "local", "test")
    args = ("--size", "small", "--local-ckpt-every", "5")  # 2 ranks × 4 × 9.6 MiB = 77 MiB
    check_tier(local, LM, args, 1, 2, str(tmp_path))

    class Small:
        f_blocks, f_frsize = 16, 2**20  # a 16 MiB folder
    monkeypatch.setattr(gpu_fit.os, "statvfs", lambda _: Small())
    with pytest.raises(UsageError) as e:
        check_tier(local, LM, args, 1, 2, str(tmp_path))
    assert f"the size of {tmp_path} on this machine" in e.value.one_line()
    assert "HPCJOBS_LOCAL_CKPT_DIR names a larger node-local folder" in str(e.value.hint)


def test_the_local_backend_refuses_a_tier_larger_than_dev_shm(tmp_path: Path) -> None:
    out = hpcjobs("submit", "--profile", str(REPO / "cluster_profiles" / "local.yaml"), "--gpus", "8", "--dry-run",
                  "--no-snapshot", LM, "--size", "1b", "--strategy", "ddp", "--local-ckpt-every", "5", cwd=REPO)
    assert out.returncode == 2 and out.stdout == "", out  # 8 × 4 × 13.6 GiB = 434 GiB
    assert "the size of /dev/shm on this machine" in out.stderr and len(out.stderr.strip().splitlines()) == 1
