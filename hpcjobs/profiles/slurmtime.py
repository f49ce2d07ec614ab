"""Slurm's time and memory notations, parsed and printed (pure)."""

from __future__ import annotations

import re

from hpcjobs.protocol.errors import UsageError, shown

TIME_FORMS = "MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS"
# Slurm keeps a time limit as a 32-bit count of minutes, so no field of a time it takes has more than 10 digits; an
# unbounded field reached int(), which refuses over 4300 digits with a ValueError (a traceback, not a usage error).
# ASCII: \d also matches other scripts' digits (a full-width １), which int() reads and Slurm would not.
_TIME = re.compile(r"^(?:(\d{1,10})-)?(\d{1,10})(?::(\d{1,10}))?(?::(\d{1,10}))?$", re.ASCII)
MAX_MINUTES = 2**32 - 2
"""The longest finite time limit Slurm keeps (its INFINITE is 2**32 - 1 minutes)."""
_MEM = re.compile(r"^(\d+)([KMGT]?)$", re.IGNORECASE | re.ASCII)
MAX_MEM_MB = 2**63 - 1
"""Slurm keeps a memory size in megabytes in 64 bits, one of them a flag."""
_MEM_KIB = {"K": 1, "": 1024, "M": 1024, "G": 1024**2, "T": 1024**3}
"""KiB per unit: whole numbers, so a long size cannot overflow a float on its way to megabytes."""


def parse_time(text: str | int, what: str = "time") -> int:
    """Seconds in a Slurm time string; a bare number means minutes, as in Slurm."""
    if isinstance(text, int) and not isinstance(text, bool):
        text = str(text)
    if not isinstance(text, str):
        raise UsageError(f"{what} {shown(text)} is not a time; valid forms: {TIME_FORMS}.", "e.g. --time 4:00:00")
    m = _TIME.match(text.strip())
    if not m:
        raise UsageError(f"{what} {shown(text)} is not a Slurm time; valid forms: {TIME_FORMS}.",
                         "e.g. --time 4:00:00")
    days, a, b, c = m.groups()
    a_, b_, c_ = int(a), int(b or 0), int(c or 0)
    # Only the leading field may run over (90 minutes, 100:00:00); a later one past its unit is a typo, not a time.
    trailing = [(b_, 60), (c_, 60)] + ([(a_, 24)] if days is not None else [])
    if any(value >= limit for value, limit in trailing):
        raise UsageError(f"{what} {text!r} has a field past its unit (minutes and seconds 0-59, hours 0-23 after "
                         f"a day count); valid forms: {TIME_FORMS}.", "e.g. --time 1:40:00 or 1-12:00:00")
    if days is not None:  # D-HH[:MM[:SS]]
        seconds = int(days) * 86400 + a_ * 3600 + b_ * 60 + c_
    elif c is not None:  # HH:MM:SS
        seconds = a_ * 3600 + b_ * 60 + c_
    elif b is not None:  # MM:SS
        seconds = a_ * 60 + b_
    else:  # MM
        seconds = a_ * 60
    if seconds <= 0:
        raise UsageError(f"{what} {text!r} is zero; it must be positive.", "e.g. --time 30 (minutes) or 1:00:00")
    if seconds > MAX_MINUTES * 60:
        raise UsageError(f"{what} {text!r} is longer than Slurm keeps; valid: at most {format_time(MAX_MINUTES * 60)}"
                         f" ({MAX_MINUTES} minutes).", "e.g. --time 7-00:00:00; a job requeues itself to go on longer")
    return seconds


def format_time(seconds: int) -> str:
    """Slurm's D-HH:MM:SS (or HH:MM:SS under a day)."""
    days, rest = divmod(int(seconds), 86400)
    h, rest = divmod(rest, 3600)
    m, s = divmod(rest, 60)
    return f"{days}-{h:02d}:{m:02d}:{s:02d}" if days else f"{h:02d}:{m:02d}:{s:02d}"


def parse_mem_mb(text: str | int, what: str = "memory") -> int:
    """Megabytes in a Slurm memory string (500M, 64G, or a bare number of MB)."""
    m = _MEM.match(str(text).strip()) if isinstance(text, (str, int)) else None  # str() of a nested list: unbounded
    if not m or int(m.group(1)) <= 0:
        raise UsageError(f"{what} {shown(text)} is not a memory size; valid: a positive number with K, M, G or T.",
                         "e.g. mem_per_gpu: 64G")
    mb = max(1, int(m.group(1)) * _MEM_KIB[m.group(2).upper()] // 1024)
    if mb > MAX_MEM_MB:
        raise UsageError(f"{what} {shown(text)} is larger than Slurm keeps; valid: at most {MAX_MEM_MB}M.",
                         "e.g. mem_per_gpu: 64G")
    return mb
