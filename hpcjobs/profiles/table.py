"""The reference table of profile keys (docs/reference/profiles.md), generated from the `ClusterProfile` dataclass:
each key's default, its docstring and its constraints, read off the fields the validator reads
(hpcjobs.profiles.cluster_profile), with the schema vocabulary and table writer the trainer flags' table uses too
(hpcjobs.protocol.settings.schema)."""

from __future__ import annotations

import dataclasses
from typing import Any

from hpcjobs.profiles.cluster_profile import ClusterProfile
from hpcjobs.profiles.keycheck import int_valid, keys, types_of
from hpcjobs.protocol.settings.schema import field_docs, shown_default, table


def _meaning(cls: type, f: dataclasses.Field[Any]) -> str:
    doc = field_docs(cls)[f.name]
    if "min" in f.metadata or "max" in f.metadata:
        doc += f" Valid: {int_valid(f.metadata.get('min'), f.metadata.get('max'))}."
    if "choices" in f.metadata:
        doc += f" Valid: one of {', '.join(f'`{c}`' for c in f.metadata['choices'])}."
    return doc


def _rows(cls: type, prefix: str = "") -> list[tuple[str, str, str]]:
    rows = []
    for name, f in keys(cls).items():
        tp = types_of(cls)[name]
        if dataclasses.is_dataclass(tp):
            rows += _rows(tp, f"{prefix}{name}.")  # type: ignore[arg-type]
        else:
            rows.append((f"`{prefix}{name}`", shown_default(f), _meaning(cls, f)))
    return rows


def reference_table() -> str:
    """The Markdown table of every profile key (| key | default | meaning |), as docs/reference/profiles.md shows it."""
    return table(("key", "default", "meaning"), _rows(ClusterProfile))
