"""The checkpoint window (issue 41 item 3): at submit, the stop checkpoint's size against preemption.seconds_before
and the profile's storage.write_gb_per_s, one warning line when the save cannot commit in time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import REPO, hpcjobs
from hpcjobs.profiles.cluster_profile import parse_profile
from hpcjobs.protocol.errors import ProfileError
from hpcjobs.protocol.planning.lmsizes import SIZES, n_params
from hpcjobs.request.ckpt_window import checkpoint_bytes, window_line
from hpcjobs.request.hf_config import model_shape

DATA = REPO / "tests" / "data" / "hf"
SLOW = "scheduler: slurm\ngpus_per_node: 8\ngpu_memory: 80GB\nmax_nodes: 64\npreemption:\n  seconds_before: 120\n"


def profile_file(tmp_path: Path, rate: str | None) -> str:
    path = tmp_path / "cluster.yaml"
    path.write_text(SLOW + (f"storage:\n  write_gb_per_s: {rate}\n" if rate else ""))
    return str(path)


def test_a_70b_stop_checkpoint_at_120_s_and_a_slow_rate_gets_the_line(tmp_path: Path) -> None:
    shape, _ = model_shape(str(DATA / "llama-2-70b.json"))
    assert shape.params == 68_976_648_192 and checkpoint_bytes(shape) == 12 * shape.params  # ~828 GB
    profile = parse_profile({"preemption": {"seconds_before": 120}, "storage": {"write_gb_per_s": 2}}, "slow", "t")
    line = window_line(profile, checkpoint_bytes(shape), "Llama-2-70B")
    assert line is not None and "about 828 GB" in line and "~414 s" in line and "120 s warning" in line, line
    assert "HINT: preemption.seconds_before 450 or more" in line and "storage writing 7.9 GB/s" in line, line
    fast = parse_profile({"preemption": {"seconds_before": 120}, "storage": {"write_gb_per_s": 10}}, "fast", "t")
    assert window_line(fast, checkpoint_bytes(shape), "Llama-2-70B") is None
    out = hpcjobs("plan", "--model", str(DATA / "llama-2-70b.json"), "--profile", profile_file(tmp_path, "2"),
                  "--nodes", "8", "--strategy", "fsdp", "--activation-checkpointing", "--batch-size", "1")
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1].startswith("warning: the stop checkpoint")


def test_submit_says_it_in_one_line_for_the_bundled_7b(tmp_path: Path) -> None:
    assert checkpoint_bytes(SIZES["7b"]) == 12 * n_params(SIZES["7b"])  # ~77 GB
    args = ("submit", "--nodes", "2", "--gpus", "8", "--dry-run", "--no-snapshot", "trainers.tasks.lm", "--size", "7b")
    slow = hpcjobs(args[0], "--profile", profile_file(tmp_path, "0.5"), *args[1:], cwd=REPO)
    assert slow.returncode == 0, slow.stderr
    said = [ln for ln in slow.stderr.splitlines() if "stop checkpoint" in ln]
    assert len(said) == 1 and said[0].startswith("hpcjobs submit: warning: the stop checkpoint of trainers.tasks.lm "
                                                 "--size 7b is about 77 GB: at 0.5 GB/s"), slow.stderr
    assert "HINT: preemption.seconds_before 180 or more" in said[0]
    fast = hpcjobs(args[0], "--profile", profile_file(tmp_path, "5"), *args[1:], cwd=REPO)
    unknown = hpcjobs(args[0], "--profile", profile_file(tmp_path, None), *args[1:], cwd=REPO)
    assert "stop checkpoint" not in fast.stderr + unknown.stderr


def test_the_rate_key_is_checked_at_load() -> None:
    assert parse_profile({"storage": {"write_gb_per_s": 0.5}}, "x", "t").storage.write_gb_per_s == "0.5"
    assert parse_profile({}, "x", "t").storage.write_gb_per_s is None
    for bad in ("fast", -1, 0, True):
        with pytest.raises(ProfileError, match="storage.write_gb_per_s is .*; valid: a positive number of GB/s"):
            parse_profile({"storage": {"write_gb_per_s": bad}}, "x", "t")


def test_plan_json_carries_the_checkpoint_size(tmp_path: Path) -> None:
    out = hpcjobs("plan", "--model", str(DATA / "mistral-7b.json"), "--profile", profile_file(tmp_path, "0.5"),
                  "--json")
    found = json.loads(out.stdout)
    assert found["checkpoint_bytes"] == 12 * 7_248_023_552 and "stop checkpoint" in found["checkpoint_warning"]
