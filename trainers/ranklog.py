"""The node's one logger for its own lines (`hpcjobs: ...`, `[hpcjobs rank 0] ...`): what the launcher, the stop
protocol, the watchdog, the fault injector, the integrations, the shared trainer (its log lines, the meter's step and
val_loss lines), the checkpoint manager and the node-local tier say, with the wording and the stream each line had
as a print (tests and bench/kill_campaign.py's regexes read them).

Why a logger and not prints: which rank speaks was decided five ways (an `if rank == 0` around a print, a helper
reading RANK, a helper that sends other ranks' lines to their log file only); here one filter decides it (rank 0,
unless a line is for every rank), and other ranks' lines can go to their own log file (`log_only`, the launcher's
Tee) instead of nowhere.

The logger `hpcjobs.node` does not propagate: a user's `logging.basicConfig` neither duplicates nor reformats these
lines, and ours never reach the user's handlers. Its handler looks the stream up when it writes (sys.stdout for
`say`, sys.stderr for `warn`), never at import: pytest's capsys swaps sys.stdout/sys.stderr and the launcher's Tee
swaps fds 1 and 2 after this module is imported, and both must keep seeing the lines. Every line is flushed, as the
prints were (flush=True). A signal handler's line is no logger call (a handler may interrupt one holding the
handler's lock): trainers.standby writes those with os.write.

Cost, measured on the 2-core test host (stdout to /dev/null, best of 5 x 20,000 lines): a `say` 21 us against a
flushed print's 3.5 us, a line the rank filter drops 15 us; the node says a handful of lines a start.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable

NAME = "hpcjobs.node"
SAY, WARN = logging.INFO, logging.WARNING
"""The two levels: SAY's lines go to stdout, WARN's (and anything above) to stderr."""


def env_rank() -> int:
    """This process's rank as its launcher exported it (RANK; 0 when unset or no number)."""
    try:
        return int(os.environ.get("RANK") or 0)
    except ValueError:
        return 0


def speaks(record: logging.LogRecord) -> bool:
    """Whether the line goes to the terminal: rank 0's, or one for every rank (`every_rank`)."""
    rank = getattr(record, "rank", None)
    return bool(getattr(record, "every_rank", False)) or (env_rank() if rank is None else rank) == 0


class RankFilter(logging.Filter):
    """Rank 0's lines, and every rank's where the line says so; `inverse`: the others (for the log file only)."""

    def __init__(self, inverse: bool = False) -> None:
        super().__init__()
        self.inverse = inverse

    def filter(self, record: logging.LogRecord) -> bool:
        return speaks(record) != self.inverse


class StreamAtWrite(logging.Handler):
    """Writes each line to sys.stdout (below WARN) or sys.stderr as they are at that moment, and flushes."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr if record.levelno >= WARN else sys.stdout
            stream.write(f"{self.format(record)}\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - logging's own policy for a broken stream
            self.handleError(record)


class LogOnly(logging.Handler):
    """The lines the rank filter keeps off the terminal, into this rank's log file when one is attached (`sink`:
    the launcher's Tee.log_only); else nowhere, as before."""

    def __init__(self) -> None:
        super().__init__()
        self.sink: Callable[[str], None] | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.sink is not None:
            try:
                self.sink(self.format(record))
            except Exception:  # noqa: BLE001 - as StreamAtWrite
                self.handleError(record)


def _logger() -> tuple[logging.Logger, LogOnly]:
    logger = logging.getLogger(NAME)
    logger.propagate = False
    logger.setLevel(SAY)
    for old in list(logger.handlers):  # a reload (tests) must not double every line
        logger.removeHandler(old)
    terminal, file_only = StreamAtWrite(), LogOnly()
    terminal.addFilter(RankFilter())
    file_only.addFilter(RankFilter(inverse=True))
    logger.addHandler(terminal)
    logger.addHandler(file_only)
    return logger, file_only


LOGGER, LOG_ONLY = _logger()


def log_only_to(sink: Callable[[str], None] | None) -> None:
    """Where other ranks' lines go from now on: their log file (the launcher's Tee.log_only), None for nowhere."""
    LOG_ONLY.sink = sink


def say(line: str, every_rank: bool = False, rank: int | None = None) -> None:
    """`line` on stdout, from rank 0 (`rank`: this one's, where the caller knows it; else RANK) or from every rank."""
    LOGGER.log(SAY, "%s", line, extra={"every_rank": every_rank, "rank": rank})


def warn(line: str, every_rank: bool = False, rank: int | None = None) -> None:
    """`line` on stderr, as `say`."""
    LOGGER.log(WARN, "%s", line, extra={"every_rank": every_rank, "rank": rank})


def rank0(line: str, rank: int) -> None:
    """The shared trainer's `[hpcjobs rank 0] {line}` on stdout, said by rank 0 only: every rank reaches the same
    line, and the prefix names rank 0, so other ranks' copies go nowhere (not to their log file either)."""
    if rank == 0:
        say(f"[hpcjobs rank 0] {line}", rank=rank)
