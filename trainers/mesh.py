"""FSDP2's device mesh (issue 41, items 1 and 4): 1-D over every rank, or under --replicate-degree R a 2-D
(replicate, shard) mesh of R groups of world/R consecutive ranks.

Its process groups are the trainer's like the default group: `init_device_mesh` makes the replicate and shard
groups with torch's default timeout (10 minutes on NCCL), so each is handed to the DistContext, which gives it the
start-up timeout now and the collective timeout after the first step; NCCL's flight recorder is set in the
environment before the first group is made, and every NCCL group made later reads the same settings.

The 2-D mesh takes consecutive ranks as a shard group, which keeps the sharding collectives inside a node only when
each node's ranks are consecutive (node-major: srun's block distribution). Before it is built, the ranks compare
their nodes: a shard group that takes part of a node and part of another (a cyclic distribution) is refused in one
line rather than left to all-gather across nodes without a word.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from hpcjobs.protocol.settings.trainconfig import TrainConfig
from hpcjobs.protocol.settings.trainflags import ConfigError, check_world
from trainers.dist import DistContext


def device_mesh(ctx: DistContext, cfg: TrainConfig) -> Any:
    """The mesh, its groups under the trainer's timeouts. Raises ConfigError (on every rank alike) for a replicate
    degree that does not divide the ranks or a rank order whose shard groups would span nodes."""
    from torch.distributed.device_mesh import init_device_mesh

    world, replicate = ctx.world_size, cfg.replicate_degree
    if replicate == 1:
        mesh = init_device_mesh(ctx.device.type, (world,))
    else:
        check_world(cfg, world)
        check_node_major(rank_nodes(ctx), replicate)
        mesh = init_device_mesh(ctx.device.type, (replicate, world // replicate),
                                mesh_dim_names=("replicate", "shard"))
    ctx.adopt(mesh.get_all_groups())
    return mesh


def node_name() -> str:
    return os.uname().nodename


def rank_nodes(ctx: DistContext) -> list[str]:
    """Each rank's node, by rank: one small collective on the control group (every rank calls it)."""
    nodes: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(nodes, node_name(), group=ctx.control_group)
    return [str(n) for n in nodes]


def check_node_major(nodes: list[str], replicate: int) -> None:
    """Refuse (ConfigError, one line) a layout where a shard group of world/`replicate` consecutive ranks takes
    some of a node's ranks and not all of them while spanning more than one node: its all-gathers and
    reduce-scatters would cross nodes. A group within one node, or of whole nodes, is fine."""
    size = len(nodes) // replicate
    for first in range(0, len(nodes), size):
        group = nodes[first:first + size]
        hosts = list(dict.fromkeys(group))
        split = [h for h in hosts if group.count(h) != nodes.count(h)]
        if len(hosts) > 1 and split:
            order = " ".join(nodes[:8]) + (" ..." if len(nodes) > 8 else "")
            raise ConfigError(
                f"--replicate-degree {replicate}: shard group of ranks {first}-{first + size - 1} spans nodes "
                f"{', '.join(hosts[:4])}{' ...' if len(hosts) > 4 else ''} and holds only part of {split[0]}'s "
                f"ranks (rank order by node: {order}); valid: each node's ranks consecutive (node-major, srun's "
                "block distribution), so that each shard group lies within a node or takes whole nodes. HINT: drop "
                "a cyclic distribution (srun -m/--distribution, or its variable in the job's environment) from the "
                "profile's srun_args, or drop --replicate-degree to shard over all ranks")
