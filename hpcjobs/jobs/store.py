"""The local record of submitted jobs: stdlib sqlite in WAL mode, so several shells can submit and list at once
without losing a record (sqlite serialises writers with a file lock; a busy timeout makes them wait, not fail)."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcjobs.protocol.errors import RuntimeFailure
from hpcjobs.protocol.paths import existing_ancestor
from hpcjobs.protocol.runfolder import split_task_id

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
  id INTEGER PRIMARY KEY AUTOINCREMENT,
  job_id TEXT NOT NULL,
  name TEXT NOT NULL,
  profile TEXT NOT NULL,
  scheduler TEXT NOT NULL,
  nodes INTEGER NOT NULL,
  gpus_per_node INTEGER NOT NULL,
  run_dir TEXT NOT NULL,
  logs TEXT NOT NULL,
  spec TEXT NOT NULL,
  submitted REAL NOT NULL,
  cancelled REAL
);
CREATE INDEX IF NOT EXISTS jobs_job_id ON jobs(job_id);
"""


@dataclass(frozen=True)
class JobRecord:
    job_id: str
    name: str
    profile: str
    scheduler: str
    nodes: int
    gpus_per_node: int
    run_dir: str
    logs: dict[str, Any]
    spec: dict[str, Any]
    submitted: float
    cancelled: float | None = None


def store_path() -> Path:
    home = os.environ.get("HPCJOBS_HOME") or os.path.join(
        os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share"), "hpcjobs")
    return Path(home) / "jobs.sqlite"


def _set_up(con: sqlite3.Connection, tries: int = 20) -> None:
    """WAL mode and the schema. Two shells that create the store at the same moment can be answered "database is
    locked" at once, without the busy timeout (switching to WAL takes the lock the other holds): try again."""
    for attempt in range(tries):
        try:
            con.execute("PRAGMA busy_timeout=30000")
            con.execute("PRAGMA journal_mode=WAL")
            con.executescript(SCHEMA)
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or attempt == tries - 1:
                raise
            time.sleep(0.05 * (attempt + 1))


def _object(text: Any) -> dict[str, Any]:
    """A JSON column as add() wrote it (an object); {} where the file was damaged since: the record still names
    its job and run folder, which is what status and logs need first."""
    try:
        value = json.loads(text)
    except (TypeError, ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


class JobStore:
    def __init__(self, path: Path | None = None) -> None:
        self.path = path or store_path()

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        """A connection with the schema in place; any fault of the file or its folder becomes one RuntimeFailure."""
        place = existing_ancestor(self.path.parent)
        if not place.is_dir():  # mkdir would say "File exists" of the file on the way
            raise RuntimeFailure(f"the job store {self.path} cannot be made: {place} is a file, not a folder.",
                                 "HPCJOBS_HOME (or XDG_DATA_HOME) picks another folder.")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            with closing(sqlite3.connect(self.path, timeout=30, isolation_level=None)) as con:
                _set_up(con)
                if self.path.stat().st_mode & 0o077:  # the owner's alone whatever the umask (and the -wal)
                    for path in (self.path, self.path.with_name(self.path.name + "-wal")):
                        with contextlib.suppress(FileNotFoundError):
                            path.chmod(0o600)
                yield con
        except (sqlite3.Error, OSError) as e:
            raise RuntimeFailure(
                f"the job store {self.path} cannot be used ({getattr(e, 'strerror', None) or e}).",
                f"HPCJOBS_HOME picks another folder; a damaged file can be moved aside (mv {self.path} "
                f"{self.path}.bad) and a new one starts empty.") from None

    def check(self) -> None:
        """Open the store and write nothing: a job must never be queued that could then not be recorded."""
        with self._connect() as con:
            con.execute("BEGIN IMMEDIATE")  # takes the write lock: a read-only file or folder fails here
            con.execute("ROLLBACK")

    def add(self, rec: JobRecord) -> None:
        with self._connect() as con:
            con.execute("INSERT INTO jobs (job_id, name, profile, scheduler, nodes, gpus_per_node, run_dir, logs, "
                        "spec, submitted, cancelled) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                        (rec.job_id, rec.name, rec.profile, rec.scheduler, rec.nodes, rec.gpus_per_node,
                         rec.run_dir, json.dumps(rec.logs), json.dumps(rec.spec), rec.submitted, rec.cancelled))

    def mark_cancelled(self, job_id: str) -> None:
        with self._connect() as con:
            con.execute("UPDATE jobs SET cancelled=? WHERE id=(SELECT MAX(id) FROM jobs WHERE job_id=?)",
                        (time.time(), job_id))

    def _rows(self, sql: str, args: tuple[Any, ...]) -> Iterator[JobRecord]:
        if not self.path.exists():  # nothing submitted from here yet: a question makes no store
            return
        with self._connect() as con:
            for row in con.execute(sql, args).fetchall():
                yield JobRecord(row[0], row[1], row[2], row[3], row[4], row[5], row[6], _object(row[7]),
                                _object(row[8]), row[9], row[10])

    _COLS = "job_id, name, profile, scheduler, nodes, gpus_per_node, run_dir, logs, spec, submitted, cancelled"

    def get(self, job_id: str) -> JobRecord | None:
        """The newest record with this id (ids repeat when a cluster is rebuilt)."""
        rows = list(self._rows(f"SELECT {self._COLS} FROM jobs WHERE job_id=? ORDER BY id DESC LIMIT 1",
                               (job_id,)))
        return rows[0] if rows else None

    def tasks(self, array_id: str) -> list[JobRecord]:
        """An array's tasks (`ID_0`, `ID_1`, ...; the newest record of each), in task order."""
        rows = self._rows(f"SELECT {self._COLS} FROM jobs WHERE job_id LIKE ? ESCAPE '\\' ORDER BY id",
                          (array_id.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "\\_%",))
        newest: dict[int, JobRecord] = {}
        for rec in rows:  # oldest first: a later record of the same task replaces an earlier one
            array, index = split_task_id(rec.job_id)
            if array == array_id and index is not None:
                newest[index] = rec
        return [newest[i] for i in sorted(newest)]

    def recent(self, limit: int = 50, profile: str | None = None) -> list[JobRecord]:
        where, args = ("WHERE profile=?", (profile,)) if profile else ("", ())
        return list(self._rows(f"SELECT {self._COLS} FROM jobs {where} ORDER BY id DESC LIMIT ?", (*args, limit)))

    def of_command(self, key: str) -> list[JobRecord]:
        """The jobs of one `hpcjobs submit` command (its key, hpcjobs.request.commandkey, in their spec), newest
        first: where the same command continues."""
        rows = self._rows(f"SELECT {self._COLS} FROM jobs WHERE spec LIKE ? ESCAPE '\\' ORDER BY id DESC",
                          (f'%"command": "{key}"%',))
        return [rec for rec in rows if rec.spec.get("command") == key]
