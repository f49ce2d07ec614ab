"""How much of each time-limit chunk a queued job trains for, said at submit when it is little. A job longer than its
time limit goes on in chunks: each start pays the start-up (the ranks launched, torch imported, the group joined, the
first step), and each stop gives the last `preemption.seconds_before` seconds to the warning. With `--time 2:00`, a
60 s warning and a 45 s start-up, a chunk trained for about 15 s (issue 38: 2-19 steps a chunk on a busy cluster).
One warning line, not a refusal: a job that fits one chunk loses nothing. Torch-free, reads only."""

from __future__ import annotations

import math
import statistics

from hpcjobs.profiles.slurmtime import format_time
from hpcjobs.protocol.runfolder import FIRST_STEP, LAUNCHED, RunFolder, has_pattern, read_jsonl
from hpcjobs.request.spec import JobSpec

CHUNK_SHARE, GOOD_SHARE = 0.5, 0.8
"""A time limit's start that trains less than CHUNK_SHARE of it gets a line with the --time that leaves GOOD_SHARE."""
ASSUMED_STARTUP_S = 45
"""A start's start-up where the run folder has measured none: what a 2-node job of the shared trainer took on the
test cluster under load (issue 38); an idle one took about 10 s."""
LEAST_WARNING_S = 10
"""The smallest seconds_before a profile takes (hpcjobs.protocol.contract.Preemption)."""


def measured_startup(run_dir: str) -> float | None:
    """The median start-up (launched → first step) of rank 0 over the run folder's starts; None if it has none."""
    if has_pattern(run_dir):
        return None
    lines = read_jsonl(RunFolder(run_dir).startup)
    took = [float(r[FIRST_STEP]) - float(r[LAUNCHED]) for r in lines
            if r.get("rank", 0) == 0 and isinstance(r.get(FIRST_STEP), (int, float))
            and isinstance(r.get(LAUNCHED), (int, float)) and r[FIRST_STEP] >= r[LAUNCHED]]
    return statistics.median(took) if took else None


def chunk_warning(spec: JobSpec) -> str | None:
    """One line when the time limit leaves less than CHUNK_SHARE of each chunk for training, naming the --time that
    leaves GOOD_SHARE (as goodput's advice does, from the chunks a job ran) and, where one would do, a seconds_before
    that leaves CHUNK_SHARE; None otherwise."""
    warn = spec.profile.preemption.seconds_before
    measured = measured_startup(spec.run_dir)
    startup = measured if measured is not None else ASSUMED_STARTUP_S
    left = spec.time_seconds - warn - startup
    if left >= CHUNK_SHARE * spec.time_seconds:
        return None
    how = f"{startup:.0f} s measured in this run folder" if measured is not None else f"about {startup:.0f} s, assumed"
    time = max(spec.time_seconds + 60, math.ceil(round((warn + startup) / (1 - GOOD_SHARE) / 60, 6)) * 60)
    lower = int(spec.time_seconds * (1 - CHUNK_SHARE) - startup)
    other = (f", or lower preemption.seconds_before to {lower} in {spec.profile.source} if a checkpoint saves in "
             "less" if lower >= LEAST_WARNING_S else "")
    return (f"{spec.time_from} {format_time(spec.time_seconds)} leaves about {max(left, 0):.0f} s of each time-limit "
            f"chunk for training: the preemption warning (seconds_before {warn} of profile {spec.profile.name}) and "
            f"the start-up ({how}) come out of every chunk, so a job longer than one chunk advances little at each "
            f"requeue. HINT: ask for --time {format_time(time)} or more (it leaves ~{GOOD_SHARE:.0%} of each chunk to "
            f"training){other}.")
