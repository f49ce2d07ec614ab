"""Survivors keep their process (issue 40, item 4): when a rank dies and its peers are healthy, the launcher starts
only a replacement for it, and the peers, instead of exiting with it and being started again as new processes,
leave the broken process group, form a new one with the replacement and resume from the newest step every rank has
(the node-local tier, else shared storage). What a recovery then costs the healthy ranks is a process group and a
resume, not Python, torch's import, CUDA's context and compile caches: on the 2-core test host a rank's start is
8–12 s of mostly imports, paid by every rank for one dead one.

The launcher and the ranks meet in the run folder, which both sides see (a local job's, and on Slurm the shared
filesystem's), through three kinds of files in RUN/rejoin/, each written whole (temporary name, then rename):

- `call.json` (the launcher): generation G, the start's number R the rejoined ranks take, which ranks it replaced.
  A survivor that lost a peer waits for a call newer than its own generation; none within CALL_WAIT_S (or a stop
  signal meanwhile) and it fails as before, so the launcher's usual recovery restarts every rank.
- `gen-G.addr` (rank 0 of generation G, a survivor or a replacement): where its new store listens. Every other rank
  of G connects there: a store of its own for each generation, so nothing of the broken group is reused.
- `gen-G.joined` (rank 0 of G, once the new group stands): the launcher allows another replacement only after it;
  a rank that dies while a generation is still forming ends the job's start as before (all ranks started again).

Used only where the launcher says it can replace a rank (HPCJOBS_REJOIN=1: the local backend); without it a peer's
loss ends the rank as it always did. Torch-free: the local backend (submit side) writes the call.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from hpcjobs.protocol.runfolder import RunFolder

ON_ENV = "HPCJOBS_REJOIN"
"""Set to 1 by a launcher that replaces a dead rank and lets the others keep their processes."""
GEN_ENV = "HPCJOBS_REJOIN_GEN"
"""A replacement rank's generation (the survivors count theirs)."""
CALL_WAIT_S = 30.0
"""How long a survivor waits for the launcher's call: it polls its ranks every 0.2 s and writes the call at once."""


@dataclass(frozen=True)
class Call:
    """The launcher's call: generation `gen`, whose ranks start as start number `restart`, `ranks` replaced."""

    gen: int
    restart: int
    ranks: tuple[int, ...]
    time: float


def folder(run: RunFolder) -> Path:
    return run.path / "rejoin"


def on(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get(ON_ENV) == "1"


def generation(environ: Mapping[str, str] = os.environ) -> int:
    """This process's generation at its start: a replacement's, else 0."""
    value = environ.get(GEN_ENV, "0")
    return int(value) if value.isdigit() else 0


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def call(run: RunFolder, gen: int, restart: int, ranks: list[int]) -> Call:
    """The launcher: generation `gen` is called, its replaced `ranks` about to start."""
    c = Call(gen, restart, tuple(ranks), time.time())
    _write(folder(run) / "call.json", json.dumps(asdict(c)))
    return c


def read_call(run: RunFolder) -> Call | None:
    try:
        d = json.loads((folder(run) / "call.json").read_text())
        return Call(int(d["gen"]), int(d["restart"]), tuple(int(r) for r in d["ranks"]), float(d["time"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def await_call(run: RunFolder, after: int, give_up: Callable[[], bool], wait_s: float = CALL_WAIT_S,
               ) -> Call | None:
    """A survivor of generation `after`: the launcher's next call, or None when none comes within `wait_s` or
    `give_up()` (a stop signal: the launcher ends the start instead)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and not give_up():
        c = read_call(run)
        if c is not None and c.gen > after:
            return c
        time.sleep(0.05)
    return None


def publish(run: RunFolder, gen: int, host: str, port: int) -> None:
    _write(folder(run) / f"gen-{gen}.addr", f"{host}:{port}")


def address(run: RunFolder, gen: int, wait_s: float, give_up: Callable[[], bool]) -> tuple[str, int] | None:
    """Where generation `gen`'s store listens, once its rank 0 has said; None after `wait_s` or `give_up()`."""
    deadline = time.monotonic() + wait_s
    path = folder(run) / f"gen-{gen}.addr"
    while time.monotonic() < deadline and not give_up():
        try:
            host, port = path.read_text().rsplit(":", 1)
            return host, int(port)
        except (OSError, ValueError):
            time.sleep(0.05)
    return None


def mark_joined(run: RunFolder, gen: int) -> None:
    _write(folder(run) / f"gen-{gen}.joined", str(time.time()))


def forming(run: RunFolder) -> bool:
    """The launcher: a called generation whose group does not stand yet."""
    c = read_call(run)
    return c is not None and not (folder(run) / f"gen-{c.gen}.joined").exists()


def last_gen(run: RunFolder) -> int:
    c = read_call(run)
    return 0 if c is None else c.gen


def clear(run: RunFolder) -> None:
    """The launcher, before it starts every rank: no call or address of an earlier start is left to be taken."""
    for path in folder(run).glob("*") if folder(run).is_dir() else ():
        path.unlink(missing_ok=True)


SPARE_ENV = "HPCJOBS_SPARE"
"""Set (to the file it waits for) in a warm spare: a process the launcher starts beside the ranks, which imports
torch, the trainer and the task and then waits; a lost rank's replacement is this process when one is ready, so
the new group waits for no import (hpcjobs.backends.local.replace). The launcher writes the file, whole, with the
variables that make the spare that rank."""


SPARE_ON_ENV = "HPCJOBS_REJOIN_SPARE"
"""1: the local backend keeps a warm spare (opt-in: a spare outlived a killed launcher in the tests, so it is off by
default until that is understood; without it a lost rank's replacement is a new process, which imports torch)."""
LAUNCHER_ENV = "HPCJOBS_SPARE_LAUNCHER"
"""The pid of the launcher that started a spare: a spare whose parent is another has lost its launcher."""


def assign(path: Path, env: Mapping[str, str]) -> None:
    """The launcher: the spare waiting on `path` becomes the rank `env` describes."""
    _write(path, json.dumps(dict(env)))


def await_assignment(path: Path, gone: Callable[[], bool], poll_s: float = 0.02) -> dict[str, str] | None:
    """The spare: block until the launcher has assigned it; None once `gone()` (its launcher died)."""
    while not gone():
        try:
            return {str(k): str(v) for k, v in json.loads(path.read_text()).items()}
        except (OSError, ValueError):
            time.sleep(poll_s)
    return None
