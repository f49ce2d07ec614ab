"""Sweep points as both sides see them: the submit side builds them (hpcjobs.request.sweep), the node picks its own by
the array task's index and adds it to the entry's flags. Pure; torch-free."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hpcjobs.protocol.runfolder import RUN_DIR_FIELDS, TASK_INDEX

Point = tuple[tuple[str, str], ...]
"""One point: (flag name, value) pairs in the order they are passed."""


def as_args(point: Point) -> list[str]:
    """A point as the flags it adds to the entry's command line."""
    return [word for key, value in point for word in (f"--{key}", value)]


def array_spec(count: int, max_parallel: int | None) -> str:
    """sbatch's --array value for `count` tasks, at most `max_parallel` running at once."""
    return f"0-{count - 1}" + (f"%{max_parallel}" if max_parallel else "")


def point_of(points: Sequence[Point], environ: Mapping[str, str]) -> Point | None:
    """On the node: this array task's point (None outside a sweep), by the task index the scheduler gave it.
    Raises ValueError when a sweep's index is missing or out of range (a script run without --array, or edited)."""
    if not points:
        return None
    index = next((environ[v] for v in RUN_DIR_FIELDS[TASK_INDEX] if environ.get(v)), "")
    if not index.isdigit() or int(index) >= len(points):
        raise ValueError(f"this job is a sweep of {len(points)} points, but its array task index is "
                         f"{index or 'not set'}; valid: 0 to {len(points) - 1} (submit it as an array: "
                         f"sbatch --array={array_spec(len(points), None)})")
    return points[int(index)]
