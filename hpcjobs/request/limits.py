"""What a profile and its scheduler allow a job: how many nodes, GPUs per node and how long, and which Python the
ranks run. Split from spec.py (391 lines, at the size cap's edge): these read the profile and the backend's
capabilities only, so a Request stands in as any object with the fields each needs (no import back to spec.py).
"""

from __future__ import annotations

import sys
from typing import Protocol

from hpcjobs.profiles.cluster_profile import MAX_NODES, ClusterProfile
from hpcjobs.profiles.slurmtime import parse_time
from hpcjobs.protocol.errors import UsageError


class Capabilities(Protocol):
    """What a spec needs to know of the scheduler's backend (every hpcjobs.backends.Backend has it): the caller
    passes the backend in and runs its `check` on the spec, so the spec never looks a backend up itself."""

    @property
    def multi_node(self) -> bool: ...
    @property
    def requests_gpus(self) -> bool: ...
    @property
    def runs_setup(self) -> bool: ...


class NodesAsked(Protocol):
    """The request's fields gpus_per_node reads (hpcjobs.request.spec.Request has them)."""

    @property
    def nodes(self) -> int: ...
    @property
    def gpus(self) -> int | None: ...


class TimeAsked(Protocol):
    """The request's field time_seconds reads."""

    @property
    def time(self) -> str | None: ...


AFTER_SETUP = "python3"
"""The nodes' Python when the profile names none and has a setup: found on the node's PATH after the setup."""


def node_python(profile: ClusterProfile, caps: Capabilities) -> str:
    """The Python the ranks run (ClusterProfile.python says which and why); in an image, its own `python3`."""
    if profile.python:
        return profile.python
    return AFTER_SETUP if (profile.setup and caps.runs_setup) or profile.container.enabled else sys.executable


def node_limit(profile: ClusterProfile) -> int:
    """The most nodes the profile allows: its max_nodes, and hpcjobs' own limit otherwise."""
    return min(profile.max_nodes or MAX_NODES, MAX_NODES)


def most_nodes(profile: ClusterProfile, caps: Capabilities) -> int:
    """The most nodes a job of this profile may ask for: its node_limit, or one where its scheduler runs on this
    machine only."""
    return node_limit(profile) if caps.multi_node else 1


def more_nodes_hint(profile: ClusterProfile, caps: Capabilities, total: int) -> str:
    """How to ask for `total` GPUs the way the profile allows, never a request it would refuse."""
    per, most = profile.gpus_per_node, most_nodes(profile, caps)
    need = -(-total // per)
    if need <= most:
        return f"--gpus is per node; for {total} GPUs in all ask for more nodes, e.g. --nodes {need} --gpus {per}."
    return (f"--gpus is per node, and profile {profile.name} allows at most {most} node(s) × {per} GPUs = "
            f"{most * per} in all: e.g. --nodes {most} --gpus {per}.")


def gpus_per_node(profile: ClusterProfile, req: NodesAsked, caps: Capabilities) -> int:
    """The request's nodes and GPUs per node, checked against the profile (a single-node scheduler refuses more
    than one node in its own words: backend.check)."""
    where = f"profile {profile.name}"
    if req.nodes < 1:
        raise UsageError(f"--nodes {req.nodes}: valid: 1 or more.", "e.g. --nodes 2")
    limit = node_limit(profile)
    if req.nodes > limit:
        raise UsageError(f"--nodes {req.nodes}: {where} allows at most {limit}.", f"ask for --nodes {limit} or fewer.")
    gpus = profile.gpus_per_node if req.gpus is None else req.gpus
    if gpus < 1:
        raise UsageError(f"--gpus {gpus}: valid: 1 to {profile.gpus_per_node} (GPUs per node).", "e.g. --gpus 8")
    if gpus > profile.gpus_per_node:
        raise UsageError(f"--gpus {gpus} per node: nodes of {where} have {profile.gpus_per_node}; valid: 1 to "
                         f"{profile.gpus_per_node}.", more_nodes_hint(profile, caps, gpus * req.nodes))
    return gpus


def time_seconds(profile: ClusterProfile, req: TimeAsked) -> int:
    time_s = parse_time(req.time if req.time is not None else profile.default_time, "--time")
    if profile.max_time and time_s > parse_time(profile.max_time):
        raise UsageError(f"--time {req.time}: profile {profile.name} allows at most {profile.max_time}.",
                         f"ask for --time {profile.max_time} or less; the job requeues itself to go on longer.")
    return time_s
