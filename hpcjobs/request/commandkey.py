"""What makes two `hpcjobs submit` commands "the same command", as one short key (issue 37): a submit without
--run-dir continues the newest run of its command (hpcjobs.follow.samecommand), so the key must change with whatever
changes what trains, and with nothing else. In it: the entry (as resolved, before the code snapshot renames a
script's path), its arguments, the profile, the nodes and GPUs per node, the --env flags, --container, and the folder
the command ran from. Not in it: the time, the name, partition, account and qos, --after, the recovery flags,
--no-snapshot, and the moment and pid that name a fresh run folder. Pure: no I/O."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

from hpcjobs.profiles.cluster_profile import ClusterProfile
from hpcjobs.request.entry import Entry

KEY_VERSION = 1
"""Part of every key: a change of what goes into it makes the old keys another command's, never a wrong match."""


def command_key(profile: ClusterProfile, entry: Entry, nodes: int, gpus: int, workdir: Path, env: Sequence[str],
                container: str | None) -> str:
    """The key of a command: 16 hex digits of a SHA-256 of its parts (stored with each job record)."""
    parts = {"v": KEY_VERSION, "entry": [entry.kind, entry.target, *entry.args], "profile": profile.name,
             "profile_source": profile.source, "nodes": nodes, "gpus_per_node": gpus,
             "workdir": str(workdir.resolve()), "env": list(env), "container": container}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode("utf-8", "replace")).hexdigest()[:16]
