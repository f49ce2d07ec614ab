"""A sweep: the points one submission runs, each an array task with its own run folder. Pure; torch-free.

`--sweep lr=1e-3,3e-4 --sweep seed=1,2` is a grid (the product, first flag outermost: lr=1e-3 seed=1, lr=1e-3 seed=2,
...); `--sweep-file sweep.yaml` holds a `grid:` (the same, as a mapping of lists) and/or `points:` (a list of
mappings, run as listed, after the grid's). A point reaches the entry as flags after its own arguments
(`--lr 1e-3 --seed 1`), chosen on the node by the array task's index (`point_args`).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hpcjobs.protocol.errors import UsageError, shown
from hpcjobs.protocol.points import Point, as_args

SWEEP_FILE_KEYS = ("grid", "points")
MAX_POINTS = 10_000
"""More array tasks than this is a typo, not a sweep (Slurm's MaxArraySize defaults to 1001)."""
_KEY = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")
FLAG_HINT = "e.g. --sweep lr=1e-3,3e-4,1e-4 --sweep seed=1,2,3 (a grid), or --sweep-file sweep.yaml"
FILE_HINT = "a sweep file holds `grid: {lr: [1e-3, 3e-4]}` and/or `points: [{lr: 1e-3, seed: 1}, ...]`"


def _key(key: str, where: str, hint: str) -> str:
    name = key.strip().removeprefix("--")
    if not _KEY.fullmatch(name):
        raise UsageError(f"{where}: key {shown(key)} is not a flag name; valid: a letter, then letters, digits, '_' "
                         "or '-' (it is passed as --KEY VALUE).", hint)
    return name


def _value(value: Any, key: str, where: str, hint: str) -> str:
    """A scalar as the entry will read it on its command line."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        text = str(value)
        if text.strip() and "\n" not in text and "\r" not in text and not text.startswith("-"):
            return text
    raise UsageError(f"{where}: value {shown(value)} of {key} is not a single non-empty value; valid: a number or a "
                     "word on one line, not starting with '-'.", hint)


def _axis(key: str, values: Sequence[Any], where: str, hint: str) -> tuple[str, list[str]]:
    name = _key(key, where, hint)
    texts = [_value(v, name, where, hint) for v in values]
    if not texts:
        raise UsageError(f"{where}: {name} has no values; valid: one or more.", hint)
    repeated = sorted({t for t in texts if texts.count(t) > 1})
    if repeated:
        raise UsageError(f"{where}: {name} repeats {', '.join(repeated)}; valid: each value once.", hint)
    return name, texts


def grid(axes: Sequence[tuple[str, list[str]]], where: str, hint: str) -> list[Point]:
    names = [name for name, _ in axes]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UsageError(f"{where}: {', '.join(twice)} swept twice; valid: each key once (list all its values in "
                         "one place).", hint)
    size = 1
    for _, values in axes:
        size *= len(values)
    _check_size(size, where, hint)
    return [tuple(zip(names, combo, strict=True)) for combo in itertools.product(*(v for _, v in axes))]


def _check_size(size: int, where: str, hint: str) -> None:
    if size > MAX_POINTS:
        raise UsageError(f"{where}: {size} points; valid: at most {MAX_POINTS}.", hint)


def parse_sweep_flags(flags: Sequence[str]) -> list[Point]:
    """`--sweep KEY=V1,V2,...`, repeated: the grid of their values."""
    axes = []
    for flag in flags:
        key, eq, values = flag.partition("=")
        if not eq:
            raise UsageError(f"--sweep {shown(flag)} is not KEY=V1,V2,...", FLAG_HINT)
        axes.append(_axis(key, [v.strip() for v in values.split(",")] if values.strip() else [],
                          f"--sweep {shown(flag)}", FLAG_HINT))
    return grid(axes, "--sweep", FLAG_HINT)


def read_sweep_file(path: Path) -> list[Point]:
    """A sweep file's grid, then its listed points."""
    from hpcjobs.profiles import yamlfile  # here: the node imports this module, never this function (nor yaml)

    where = f"sweep file {path}"
    kind = yamlfile.Kind("sweep file", "--sweep-file", "`grid:` (a mapping of lists) and/or `points:` (a list of "
                                                        "mappings)")
    data = yamlfile.load(kind, path)
    if not isinstance(data, dict) or not data:
        raise UsageError(f"{where} holds {type(data).__name__}, not a mapping of {' and/or '.join(SWEEP_FILE_KEYS)}.",
                         FILE_HINT)
    unknown = sorted(str(k) for k in data if k not in SWEEP_FILE_KEYS)
    if unknown:
        raise UsageError(f"{where}: unknown key(s) {', '.join(unknown)}; valid: {', '.join(SWEEP_FILE_KEYS)}.",
                         FILE_HINT)
    points: list[Point] = []
    if "grid" in data:
        axes = data["grid"]
        if not isinstance(axes, dict) or not axes or not all(isinstance(v, list) for v in axes.values()):
            raise UsageError(f"{where}: grid must map each key to a list of values.", FILE_HINT)
        points += grid([_axis(str(k), v, f"{where}: grid", FILE_HINT) for k, v in axes.items()], where, FILE_HINT)
    if "points" in data:
        listed = data["points"]
        if not isinstance(listed, list) or not listed or not all(isinstance(p, dict) and p for p in listed):
            raise UsageError(f"{where}: points must be a non-empty list of mappings.", FILE_HINT)
        for i, mapping in enumerate(listed):
            here = f"{where}: point {i}"
            points.append(tuple((_key(str(k), here, FILE_HINT), _value(v, str(k), here, FILE_HINT))
                                for k, v in mapping.items()))
    _check_size(len(points), where, FILE_HINT)
    return points


def build_points(flags: Sequence[str], sweep_file: str | None, entry_args: Sequence[str]) -> list[Point]:
    """The points of a request (none without a sweep). Refuses a point that appears twice and a swept key the
    entry is also given directly (which one would win would depend on the entry's parser)."""
    if flags and sweep_file:
        raise UsageError("--sweep and --sweep-file together; valid: one of them.",
                         "put the grid in the file (`grid:`), or pass every axis as --sweep.")
    points = read_sweep_file(Path(sweep_file)) if sweep_file else parse_sweep_flags(flags) if flags else []
    seen: dict[Point, int] = {}
    for i, point in enumerate(points):
        key = tuple(sorted(point))
        if key in seen:
            raise UsageError(f"point {i} ({describe(point)}) is the same as point {seen[key]}; valid: each point "
                             "once.", "remove the duplicate.")
        seen[key] = i
    given = {a.split("=", 1)[0].removeprefix("--") for a in entry_args if a.startswith("--")}
    both = sorted({k for point in points for k, _ in point} & given)
    if both:
        raise UsageError(f"--{both[0]} is both swept and given to the entry; valid: one of them.",
                         f"drop --{both[0]} from the entry's arguments, or from the sweep.")
    return points


def tasks_args(args: tuple[str, ...], points: tuple[Point, ...]) -> list[tuple[str, ...]]:
    """Each task's flags for the entry, as its node reads them: the entry's, then its point's; one task unless there
    are two points or more (a single point's flags are in `args` already)."""
    return [(*args, *as_args(point)) for point in points] if len(points) > 1 else [args]


def describe(point: Point) -> str:
    return " ".join(f"{k}={v}" for k, v in point)


def as_mapping(point: Point) -> dict[str, str]:
    return dict(point)
