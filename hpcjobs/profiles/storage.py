"""The profile's `storage:` keys: how fast a job's checkpoint reaches runs_dir, so that submit can say when the stop
checkpoint cannot commit inside the preemption warning (hpcjobs.request.ckpt_window). A 70B model's weights and AdamW
state are 12 bytes a parameter, ~0.83 TB: 120 s of warning commits them only above ~7.9 GB/s, all ranks together; a
parallel filesystem's per-job share is often a few GB/s. A fact of the site, like gpu_memory: never asked of the
cluster at submit."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_RATE = 10_000.0
"""The fastest write rate taken, GB/s (10 TB/s: past any filesystem a job gets, and a finite number)."""


def parse_rate(value: object, key: str = "storage.write_gb_per_s") -> float:
    """A write rate in GB/s (1 GB = 10⁹ bytes, as storage is sold): a positive number, e.g. 2 or 0.5. Raises
    ValueError saying what is valid (`key`: the profile key, for its parsers' signature)."""
    try:
        rate = float(value) if isinstance(value, (int, float, str)) and not isinstance(value, bool) else math.nan
    except ValueError:
        rate = math.nan
    if not 0 < rate <= MAX_RATE:  # nan fails both
        raise ValueError(f"a positive number of GB/s of at most {MAX_RATE:.0f}, e.g. 2 or 0.5")
    return rate


@dataclass(frozen=True)
class Storage:
    write_gb_per_s: str | None = field(default=None, metadata={"parse": parse_rate})
    """The rate a job's checkpoint is written to runs_dir at, all its ranks together, in GB/s (e.g. `2`; as
    measured by a write of a few GB there). With it, submit says in one line when the stop checkpoint (the
    bundled LM's weights and AdamW state, 12 bytes a parameter) cannot commit within `preemption.seconds_before`,
    and the seconds_before that would do (none: not checked)."""
