"""Gloo's interface, resolved on the node from NCCL_SOCKET_IFNAME's prefixes (issue 41, item 2): NCCL takes `ib`
for ib0, ib1, ...; gloo needs an exact name, and `GLOO_SOCKET_IFNAME=ib` failed every gloo group at start."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import REPO, hpcjobs
from hpcjobs.protocol.ifnames import InterfaceError, gloo_interface, nccl_matches, node_interfaces
from trainers.distenv import DistEnvError, from_environ

NODE = ["lo", "eth0", "ib0", "ib0.8066", "ib1", "docker0"]


@pytest.mark.parametrize("setting,matched", [
    ("ib", ["ib0", "ib0.8066", "ib1"]),
    ("=ib0", ["ib0"]),
    ("=ib", []),
    ("eth,ib1", ["eth0", "ib1"]),
    ("ib1:0", ["ib1"]),  # NCCL's port suffix
    ("^docker,lo", ["eth0", "ib0", "ib0.8066", "ib1"]),
    ("^=ib0", ["lo", "eth0", "ib0.8066", "ib1", "docker0"]),
    ("bond", []),
])
def test_nccl_forms_select_as_nccl_does(setting: str, matched: list[str]) -> None:
    assert nccl_matches(setting, NODE) == matched


def test_a_prefix_gives_gloo_the_first_matching_interface_that_is_up() -> None:
    def node() -> list[str]:
        return NODE

    assert gloo_interface({"NCCL_SOCKET_IFNAME": "ib"}, node, lambda name: False) == {"GLOO_SOCKET_IFNAME": "ib0"}
    assert gloo_interface({"NCCL_SOCKET_IFNAME": "ib"}, node, lambda name: name == "ib0") == \
        {"GLOO_SOCKET_IFNAME": "ib0.8066"}
    assert gloo_interface({"NCCL_SOCKET_IFNAME": "=ib1"}, node, lambda name: True) == {"GLOO_SOCKET_IFNAME": "ib1"}


def test_gloo_named_or_nccl_unnamed_or_excluding_leaves_gloo_alone() -> None:
    def never() -> list[str]:
        raise AssertionError("the interfaces were read")

    assert gloo_interface({"NCCL_SOCKET_IFNAME": "ib", "GLOO_SOCKET_IFNAME": "eth1"}, never) == {}
    assert gloo_interface({}, never) == {} and gloo_interface({"NCCL_SOCKET_IFNAME": "^docker"}, never) == {}


def test_a_prefix_that_matches_nothing_is_one_line_naming_the_nodes_interfaces() -> None:
    with pytest.raises(InterfaceError) as e:
        gloo_interface({"NCCL_SOCKET_IFNAME": "bond"}, lambda: ["lo", "eth0"], node="node7")
    said = str(e.value)
    assert "\n" not in said and said.startswith("NCCL_SOCKET_IFNAME=bond matches no network interface of node node7 "
                                                "(it has: lo, eth0)") and "; valid: " in said and "HINT: " in said


def test_each_rank_gets_its_nodes_exact_interface_in_its_environment() -> None:
    real = node_interfaces()[-1]
    prefix = real[:-1] or real
    slurm = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_NNODES": "2",
             "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_JOB_ID": "77"}
    gloo = from_environ({**slurm, "NCCL_SOCKET_IFNAME": prefix}).as_env()["GLOO_SOCKET_IFNAME"]
    assert gloo in node_interfaces() and gloo.startswith(prefix)
    with pytest.raises(DistEnvError, match=r"^NCCL_SOCKET_IFNAME=nosuchif0 matches no network interface"):
        from_environ({**slurm, "NCCL_SOCKET_IFNAME": "nosuchif0"})


def test_a_job_whose_nccl_interface_is_not_on_the_node_stops_at_its_start_in_one_line(tmp_path: Path) -> None:
    out = hpcjobs("submit", "--profile", "local", "--gpus", "1", "--run-dir", str(tmp_path / "run"),
                  "--env", "NCCL_SOCKET_IFNAME=nosuchif0", "trainers.tasks.lm", "--size", "tiny", "--steps", "1",
                  cwd=REPO)
    said = [line for line in out.stderr.splitlines() if "nosuchif0" in line]
    assert out.returncode == 2 and len(said) == 1, out.stderr
    assert said[0].startswith("hpcjobs: NCCL_SOCKET_IFNAME=nosuchif0 matches no network interface") and "HINT:" in \
        said[0]
