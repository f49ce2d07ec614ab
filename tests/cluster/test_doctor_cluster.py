"""`hpcjobs doctor` against the live test cluster: everything passes for a request that fits; a wrong partition, a
--time over the partition's MaxTime and more GPUs than a node has each fail their rows, exit 1, and queue nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from conftest import REPO, hpcjobs, on_every_node, slurm

pytestmark = pytest.mark.cluster


def doctor(*args: str) -> tuple[int, dict[str, str], dict[str, str]]:
    out = hpcjobs("doctor", "--json", *args, cwd=REPO)  # before an entry, whose flags follow it
    said = json.loads(out.stdout)
    return out.returncode, {c["name"]: c["result"] for c in said["checks"]}, {c["name"]: c["found"]
                                                                               for c in said["checks"]}


def queued() -> str:
    return slurm("squeue", "-h", "-o", "%i")


def test_a_request_that_fits_passes_every_check(cluster_profile: Path) -> None:
    before = queued()
    code, result, found = doctor("--profile", str(cluster_profile), "--nodes", "2", "--gpus", "8", "--time", "1:00:00")
    assert code == 0 and result == {"request": "pass", "partition": "pass", "nodes": "pass", "account": "pass",
                                    "requeue": "pass", "signal": "pass", "requeue delay": "pass",
                                    "node failure": "pass"}, found  # no entry: no memory plan (issue 38)
    assert "would start at" in found["request"] and "sends SIGUSR2" in found["signal"]
    assert "waits 6 s" in found["requeue delay"] and "SlurmdTimeout=60 s" in found["node failure"]
    assert queued() == before  # --test-only queues nothing


def test_a_wrong_partition_fails(cluster_profile: Path) -> None:
    code, result, found = doctor("--profile", str(cluster_profile), "--nodes", "2", "--partition", "nosuch")
    assert code == 1 and result["request"] == "fail" and result["partition"] == "fail"
    assert "invalid partition" in found["request"] and found["partition"].endswith("valid: high, low")


def test_a_time_over_the_partitions_max_time_fails(cluster_profile: Path) -> None:
    """The test cluster's `high` allows 1:00:00. Without EnforcePartLimits Slurm takes such a job and leaves it pending
    (PartitionTimeLimit) for good, so this row is the one that says so before it queues."""
    before = queued()
    within = doctor("--profile", str(cluster_profile), "--nodes", "2", "--partition", "high", "--time", "30:00")
    assert within[0] == 0 and within[1]["partition"] == "pass" and "MaxTime 01:00:00" in within[2]["partition"]
    code, result, found = doctor("--profile", str(cluster_profile), "--nodes", "2", "--partition", "high",
                                 "--time", "2:00:00")
    assert code == 1 and result["partition"] == "fail", found
    assert found["partition"] == "high: --time 02:00:00 is over its MaxTime 01:00:00"
    assert result["request"] == "pass", found  # sbatch --test-only takes it ("would start at"): only this row says no
    assert queued() == before


def test_more_gpus_than_a_node_has_fails(cluster_profile: Path, shared_tmp: Path) -> None:
    data = yaml.safe_load(cluster_profile.read_text())
    data["gpus_per_node"] = 16  # the profile is wrong about the nodes: they have 8
    profile = shared_tmp / "sixteen.yaml"
    profile.write_text(yaml.safe_dump(data))
    code, result, found = doctor("--profile", str(profile), "--nodes", "2", "--gpus", "16")
    assert code == 1 and result["nodes"] == "fail" and result["request"] == "fail", found
    assert "0 of 2 nodes in low have 16 GPUs" in found["nodes"]


def probe(profile: Path, *entry: str) -> tuple[int, dict[str, str], dict[str, str]]:
    return doctor("--profile", str(profile), "--nodes", "2", "--gpus", "2", "--probe", "--probe-wait", "120", *entry)


def variant(cluster_profile: Path, shared_tmp: Path, **changes: object) -> Path:
    data = yaml.safe_load(cluster_profile.read_text())
    for key, value in changes.items():
        if key == "env":
            data["env"].update(value)  # type: ignore[call-overload]
        else:
            data[key] = value
    path = shared_tmp / "variant.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_the_probe_finds_the_node_side_ready(cluster_profile: Path, shared_tmp: Path) -> None:
    code, result, found = probe(cluster_profile)
    assert code == 0, found
    assert {k: result[k] for k in ("probe", "runs folder", "entry", "arguments", "GPUs", "interfaces")} == {
        "probe": "pass", "runs folder": "pass", "entry": "pass", "arguments": "pass", "GPUs": "skip",
        "interfaces": "pass"}, found
    assert found["arguments"].startswith("trainers.tasks.lm starts with its defaults on node"), found
    assert "torch " in found["probe"] and "GLOO_SOCKET_IFNAME=eth0 on node" in found["interfaces"]
    assert list((shared_tmp / "runs" / "probe").iterdir()) == []  # its script, report and output are cleaned up


def test_the_probe_names_a_task_flag_the_nodes_would_refuse(cluster_profile: Path, shared_tmp: Path) -> None:
    """What only the nodes know (the submit side checks the bundled task's flags, but not whether the nodes have
    CUDA): a rank on the node reads them, and the job would have failed there only after its wait in the queue. A
    flag the submit side can check is refused before any probe job (exit 2)."""
    code, result, found = probe(cluster_profile, "trainers.tasks.lm", "--size", "7b", "--steps", "10")
    assert code == 1 and result["arguments"] == "fail" and result["probe"] == "pass", found
    assert "would refuse --size 7b --steps 10: trainers.tasks.lm: --size 7b needs GPUs" in found["arguments"], found
    assert "\n" not in found["arguments"]
    before = queued()
    out = hpcjobs("doctor", "--profile", str(cluster_profile), "--nodes", "2", "--gpus", "2", "--probe",
                  "trainers.tasks.lm", "--size", "huge", "--steps", "10", cwd=REPO)
    assert out.returncode == 2 and out.stdout == "" and out.stderr.count("\n") == 1, out
    assert "--size: invalid choice: 'huge'; valid: --size 1b|7b|large|medium|small|tiny" in out.stderr
    assert queued() == before
    code, result, found = probe(cluster_profile, "--sweep", "size=small,tiny", "trainers.tasks.lm", "--steps", "10")
    assert code == 0 and result["arguments"] == "pass", found  # each array task's flags: the entry's, then its point's
    assert "trainers.tasks.lm starts with each of its 2 points' flags on node" in found["arguments"], found
    assert list((shared_tmp / "runs" / "probe").iterdir()) == []


def test_the_probe_names_a_setup_that_fails(cluster_profile: Path, shared_tmp: Path) -> None:
    code, result, found = probe(variant(cluster_profile, shared_tmp, setup=["echo loading the site modules",
                                                                            "module-that-does-not-exist load"]))
    assert code == 1 and result["probe"] == "fail"
    assert "ended FAILED without a report" in found["probe"] and "module-that-does-not-exist" in found["probe"]


def test_the_probe_names_a_python_without_torch(cluster_profile: Path, shared_tmp: Path) -> None:
    import sys

    base = Path(sys.base_prefix) / "bin" / "python3"  # named by the profile: that one or nothing
    code, result, found = probe(variant(cluster_profile, shared_tmp, python=str(base)))
    assert code == 1 and result["probe"] == "fail"
    assert "hpcjobs: the nodes' Python on node" in found["probe"]
    assert f"({base} -> {base}: torch is not installed for this Python)" in found["probe"], found


def test_the_probe_names_a_missing_interface(cluster_profile: Path, shared_tmp: Path) -> None:
    code, result, found = probe(variant(cluster_profile, shared_tmp, env={"GLOO_SOCKET_IFNAME": "ib0"}))
    assert code == 1 and result["interfaces"] == "fail" and result["probe"] == "pass"
    assert "GLOO_SOCKET_IFNAME=ib0: no interface 'ib0' on node" in found["interfaces"]


def test_the_probe_names_a_runs_folder_the_nodes_cannot_write(cluster_profile: Path, shared_tmp: Path) -> None:
    runs = shared_tmp / "runs"
    (runs / "probe").mkdir(parents=True)
    on_every_node("mount", "--bind", str(runs), str(runs), here=False)  # read-only on the nodes, writable here
    on_every_node("mount", "-o", "remount,ro,bind", str(runs), here=False)
    try:
        code, result, found = probe(cluster_profile)
    finally:
        on_every_node("umount", "-l", str(runs), here=False, check=False)
    assert code == 1 and result["probe"] == "fail", found
    assert "left neither its report nor its output" in found["probe"], found
    assert "the runs folder is not writable on the nodes, or not the one they see" in found["probe"], found
