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
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Bounds:
    """The valid range of a numeric setting: from `low` (inclusive, or exclusive when `above`) up to `high`; its
    field's metadata `min`, `above`, `max` and `note` (hpcjobs.protocol.settings.schema)."""

    low: float
    above: bool = False
    high: float | None = None
    note: str = ""
    """What a special value means, shown with the range (e.g. `0: never`)."""

    def holds(self, value: float) -> bool:
        low_ok = value > self.low if self.above else value >= self.low
        return low_ok and (self.high is None or value <= self.high)

    def describe(self, letter: str) -> str:
        def num(x: float) -> str:
            return str(x) if isinstance(x, int) else f"{x:g}"  # 2**63 - 1 in full, not 9.22337e+18

        if self.high is not None:
            text = f"{num(self.low)} ≤ {letter} ≤ {num(self.high)}"
        else:
            text = f"{letter} {'>' if self.above else '≥'} {num(self.low)}"
        return text + (f" ({self.note})" if self.note else "")


def bounds_of(meta: Mapping[str, Any]) -> Bounds | None:
    """The range a field's metadata gives (`min`, `above`, `max`, `note`); None where it gives no `min`."""
    if "min" not in meta:
        return None
    return Bounds(meta["min"], meta.get("above", False), meta.get("max"), meta.get("note", ""))
