"""The reference table of profile keys (docs/reference/profiles.md), generated from the `ClusterProfile` dataclass:
each key's default, its docstring and its constraints, read off the fields the validator reads (hpcjobs.profiles)."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
from typing import Any

from hpcjobs.profiles import ClusterProfile, _int_valid, _keys, _types


@functools.cache
def _field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string right under it), whitespace folded to single spaces."""
    body = ast.parse(inspect.getsource(cls)).body[0]
    assert isinstance(body, ast.ClassDef)
    docs = {}
    for a, b in zip(body.body, body.body[1:], strict=False):
        if (isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and isinstance(b, ast.Expr)
                and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)):
            docs[a.target.id] = " ".join(b.value.value.split())
    return docs


def _shown_default(f: dataclasses.Field[Any]) -> str:
    if "shown" in f.metadata:
        return str(f.metadata["shown"])
    value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    if value is None or isinstance(value, bool):
        return {None: "none", True: "true", False: "false"}[value]
    if isinstance(value, int):
        return str(value)
    return f"`{value}`" if isinstance(value, str) else f"`{list(value) if isinstance(value, tuple) else value}`"


def _meaning(cls: type, f: dataclasses.Field[Any]) -> str:
    doc = _field_docs(cls)[f.name]
    if "min" in f.metadata or "max" in f.metadata:
        doc += f" Valid: {_int_valid(f.metadata.get('min'), f.metadata.get('max'))}."
    if "choices" in f.metadata:
        doc += f" Valid: one of {', '.join(f'`{c}`' for c in f.metadata['choices'])}."
    return doc.replace("|", "\\|")


def _rows(cls: type, prefix: str = "") -> list[str]:
    rows = []
    for name, f in _keys(cls).items():
        tp = _types(cls)[name]
        if dataclasses.is_dataclass(tp):
            rows += _rows(tp, f"{prefix}{name}.")  # type: ignore[arg-type]
        else:
            rows.append(f"| `{prefix}{name}` | {_shown_default(f)} | {_meaning(cls, f)} |")
    return rows


def reference_table() -> str:
    """The Markdown table of every profile key (| key | default | meaning |), as docs/reference/profiles.md shows it."""
    return "\n".join(["| key | default | meaning |", "|---|---|---|", *_rows(ClusterProfile)]) + "\n"
