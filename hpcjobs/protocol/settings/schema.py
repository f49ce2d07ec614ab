"""Settings whose schema is their dataclass field: one mechanism for the profile's keys
(hpcjobs.profiles.cluster_profile, with `Preemption` in hpcjobs.protocol.contract) and the shared trainer's flags
(`TrainConfig`, read by hpcjobs.protocol.settings.trainflags). A setting is a field: its type and default are the
setting's, the docstring right under it says what it does, and its constraints sit in the field's metadata under these
keys:
  choices    the valid strings
  multiple   true: one or more of the choices, joined by commas (`--tracker wandb,mlflow`)
  min, max   inclusive bounds of a number
  above      true: `min` itself is not valid (`--lr` > 0)
  note       what a special value means, shown with the range (`0: never`)
  example    a valid value, for an error's HINT (`e.g. --steps 1000`)
  hint       an error's whole HINT, where an example would say too little (what each choice does)
  shown      the default as a reference table shows it, where the value itself says little
  resume     "same": a checkpoint written under another value is refused (it changes what training computes)
Profiles add keys only the loader reads (parse, prefixes, max_items, key, sbatch: see hpcjobs.profiles.cluster_profile).
The validators and the reference tables (docs/reference/profiles.md, docs/reference/trainer-flags.md) are read off the
fields; no side table holds a setting's facts. Torch-free, standard library only."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
from collections.abc import Iterable, Sequence
from typing import Any


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string right under it), whitespace folded to single spaces."""
    body = ast.parse(inspect.getsource(cls)).body[0]
    assert isinstance(body, ast.ClassDef)
    docs = {}
    for a, b in zip(body.body, body.body[1:], strict=False):
        if (isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and isinstance(b, ast.Expr)
                and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)):
            docs[a.target.id] = " ".join(b.value.value.split())
    return docs


def shown_default(f: dataclasses.Field[Any]) -> str:
    """A field's default as a reference table shows it: none, true/false, a number, or the value in backticks."""
    if "shown" in f.metadata:
        return str(f.metadata["shown"])
    value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    if value is None or isinstance(value, bool):
        return {None: "none", True: "true", False: "false"}[value]
    if isinstance(value, int | float):
        return str(value)
    return f"`{value}`" if isinstance(value, str) else f"`{list(value) if isinstance(value, tuple) else value}`"


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A Markdown table, each cell's `|` escaped so that it stays in its cell."""
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"

    return "\n".join([line(header), "|" + "---|" * len(header), *map(line, rows)]) + "\n"
