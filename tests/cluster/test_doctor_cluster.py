"""`hpcjobs doctor` against the live test cluster: everything passes for a request that fits; a wrong partition and
more GPUs than a node has each fail their rows, exit 1, and queue nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from conftest import REPO, hpcjobs, slurm

pytestmark = pytest.mark.cluster


def doctor(*args: str) -> tuple[int, dict[str, str], dict[str, str]]:
    out = hpcjobs("doctor", *args, "--json", cwd=REPO)
    said = json.loads(out.stdout)
    return out.returncode, {c["name"]: c["result"] for c in said["checks"]}, {c["name"]: c["found"]
                                                                               for c in said["checks"]}


def queued() -> str:
    return slurm("squeue", "-h", "-o", "%i")


def test_a_request_that_fits_passes_every_check(cluster_profile: Path) -> None:
    before = queued()
    code, result, found = doctor("--profile", str(cluster_profile), "--nodes", "2", "--gpus", "8", "--time", "1:00:00")
    assert code == 0 and result == {"request": "pass", "partition": "pass", "nodes": "pass", "account": "pass",
                                    "requeue": "pass", "signal": "pass"}, found
    assert "would start at" in found["request"] and "sends SIGUSR2" in found["signal"]
    assert queued() == before  # --test-only queues nothing


def test_a_wrong_partition_fails(cluster_profile: Path) -> None:
    code, result, found = doctor("--profile", str(cluster_profile), "--nodes", "2", "--partition", "nosuch")
    assert code == 1 and result["request"] == "fail" and result["partition"] == "fail"
    assert "invalid partition" in found["request"] and found["partition"].endswith("valid: high, low")


def test_more_gpus_than_a_node_has_fails(cluster_profile: Path, shared_tmp: Path) -> None:
    data = yaml.safe_load(cluster_profile.read_text())
    data["gpus_per_node"] = 16  # the profile is wrong about the nodes: they have 8
    profile = shared_tmp / "sixteen.yaml"
    profile.write_text(yaml.safe_dump(data))
    code, result, found = doctor("--profile", str(profile), "--nodes", "2", "--gpus", "16")
    assert code == 1 and result["nodes"] == "fail" and result["request"] == "fail", found
    assert "0 of 2 nodes in low have 16 GPUs" in found["nodes"]
