"""FSDP's device mesh on 4 gloo ranks (issue 41, items 1 and 4): every group of a 2-D (replicate, shard) mesh gets
the trainer's timeouts (torch makes them with its default: 10 minutes on NCCL, 30 on gloo, so a hung peer under
HSDP was found by the watchdog alone and no flight-recorder dump was written), and a rank order whose shard groups
would span nodes (srun's cyclic distribution) is refused in one line on every rank."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp

from hpcjobs.protocol.ports import free_port
from hpcjobs.protocol.settings.trainflags import ConfigError


def _fake_node(name: str) -> None:
    real = os.uname()
    os.uname = lambda: os.uname_result((real.sysname, name, real.release, real.version, real.machine))


def _timeouts(groups: list[Any]) -> list[float]:
    import torch

    return [g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in groups]


def _rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from hpcjobs.protocol.settings.trainflags import parse_trainer_args
    from trainers.dist import distributed
    from trainers.strategy import device_mesh

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": "4", "LOCAL_RANK": str(rank % 2), "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "HPCJOBS_COLLECTIVE_TIMEOUT": "7"})
    cfg, _ = parse_trainer_args(["--strategy", "fsdp", "--replicate-degree", "2"])
    said: dict[str, Any] = {}
    with distributed(timeout_s=60) as ctx:
        _fake_node(f"node{rank % 2 + 1}")  # cyclic: ranks 0, 2 on node1; 1, 3 on node2
        try:
            device_mesh(ctx, cfg)
            said["cyclic"] = "built"
        except ConfigError as e:
            said["cyclic"] = str(e)
        _fake_node(f"node{rank // 2 + 1}")  # node-major: ranks 0, 1 on node1; 2, 3 on node2
        mesh = device_mesh(ctx, cfg)
        groups = [mesh.get_group(name) for name in ("replicate", "shard")]
        said["ranks"] = [dist.get_process_group_ranks(g) for g in groups]
        said["at start"] = _timeouts(groups)
        ctx.training_timeout()
        said["after first step"] = _timeouts(groups)
        said["default"] = _timeouts([dist.distributed_c10d._get_default_group()])
        said["control"] = _timeouts([ctx.control_group])
    Path(f"{out}-{rank}").write_text(json.dumps(said))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = str(tmp_path_factory.mktemp("mesh") / "said")
    mp.spawn(_rank, args=(free_port(), out), nprocs=4)
    return [json.loads(Path(f"{out}-{rank}").read_text()) for rank in range(4)]


@pytest.mark.train
def test_every_group_of_a_2d_mesh_gets_the_trainers_timeouts(four_ranks: list[dict[str, Any]]) -> None:
    for rank, said in enumerate(four_ranks):
        assert said["ranks"] == [[rank % 2, rank % 2 + 2], [rank // 2 * 2, rank // 2 * 2 + 1]], said
        assert said["at start"] == [60.0, 60.0], said  # the start-up timeout, as the default group's
        assert said["after first step"] == [7.0, 7.0] and said["default"] == [7.0], said
        assert said["control"] == [1800.0], said  # checkpoint barriers and the stop agreement keep theirs


@pytest.mark.train
def test_a_cyclic_rank_order_under_hsdp_is_refused_in_one_line_on_every_rank(
        four_ranks: list[dict[str, Any]]) -> None:
    lines = {said["cyclic"] for said in four_ranks}
    assert len(lines) == 1, lines
    line = lines.pop()
    assert line.startswith("--replicate-degree 2: shard group of ranks 0-1 spans nodes node1, node2 and holds only "
                           "part of node1's ranks (rank order by node: node1 node2 node1 node2); valid: "), line
    assert "HINT: " in line and "\n" not in line


def test_shard_groups_within_a_node_or_of_whole_nodes_pass() -> None:
    from trainers.mesh import check_node_major

    check_node_major(["a", "a", "b", "b"], 2)  # 2 nodes x 2: a node each
    check_node_major(["a", "a", "b", "b", "c", "c", "d", "d"], 2)  # 4 nodes x 2: two whole nodes each
    check_node_major(["a"] * 8 + ["b"] * 8, 4)  # a quarter of a node each
    check_node_major(["a", "a", "a", "b", "b", "b"], 2)  # nodes of 3 ranks, shard groups of 3
    for nodes, replicate in ((["a", "b", "a", "b"], 2), (["a", "a", "b", "b", "c", "c"], 2),
                             (["a", "b", "c", "d"] * 2, 2)):
        with pytest.raises(ConfigError, match=r"spans nodes .*; valid: each node's ranks consecutive"):
            check_node_major(nodes, replicate)
