"""What every tracker shares: the package check every rank makes, RUN/tracker.json, whose run it is, and the guard
that keeps a failing tracker from stopping training (see trainers/tracking/__init__.py)."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from hpcjobs.protocol.runfolder import RunFolder, read_json, write_json_atomic
from hpcjobs.protocol.settings.trainconfig import TRACKERS
from hpcjobs.protocol.trackerpkgs import TrackerUnavailable as TrackerUnavailable  # re-exported
from hpcjobs.protocol.trackerpkgs import require as require
from hpcjobs.protocol.trackerpkgs import unavailable
from trainers import ranklog


def say(message: str) -> None:
    """A tracker's line; only rank 0 has trackers, so each line it says is for the terminal."""
    ranklog.say(f"[hpcjobs rank 0] {message}", every_rank=True)


# --- packages ---------------------------------------------------------------------------------------------------

def import_package(name: str) -> Any:
    """The tracker's package, or TrackerUnavailable when it cannot be imported."""
    module = TRACKERS[name]
    assert module is not None, name
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise unavailable(name, module, f" ({type(e).__name__}: {e})") from None


# --- RUN/tracker.json -------------------------------------------------------------------------------------------

class TrackerFile:
    """RUN/tracker.json: per tracker, its run's id and each metric's last logged step. Rank 0 alone reads and writes
    it, once per start and after each log of a tracker that records steps (a few hundred bytes, replaced
    atomically: a kill never leaves half of it)."""

    def __init__(self, run: RunFolder) -> None:
        self.path = run.tracker
        data = read_json(self.path)
        self.data: dict[str, Any] = data if isinstance(data, dict) else {}

    def entry(self, name: str) -> dict[str, Any]:
        entry = self.data.get(name)
        if not isinstance(entry, dict):
            entry = self.data[name] = {}
        return entry

    def save(self) -> None:
        write_json_atomic(self.path, self.data)


@dataclass(frozen=True)
class Job:
    """Whose run it is: `name` groups runs (the mlflow experiment, the wandb project), `run_name` is this run's."""

    name: str
    run_name: str
    spec: dict[str, Any] | None

    @classmethod
    def of(cls, run: RunFolder) -> Job:
        spec = read_json(run.spec)
        spec = spec if isinstance(spec, dict) else None
        name = str(spec.get("name") or "") if spec else ""
        return cls(name=name or run.path.name, run_name=run.path.name, spec=spec)


# --- the trackers -----------------------------------------------------------------------------------------------

class TrackerBackend(Protocol):
    """A tracker's own run (wandb, MLflow, TensorBoard: trainers/tracking/*_run.py), as Guarded wraps it."""

    def log(self, values: Mapping[str, float], step: int) -> None: ...

    def close(self, finished: bool) -> None: ...


class Guarded:
    """A tracker as the Meter sees it: steps already in the tracker's run are not logged again (when `once`), each
    log is recorded in RUN/tracker.json, and the first failure turns the tracker off for the rest of the start."""

    def __init__(self, name: str, backend: TrackerBackend, state: TrackerFile, once: bool) -> None:
        self.name, self.state, self.once = name, state, once
        self.backend: TrackerBackend | None = backend
        self.logged: dict[str, int] = self._logged() if once else {}

    def _logged(self) -> dict[str, int]:
        entry = self.state.entry(self.name)
        logged = entry.get("logged")
        if not isinstance(logged, dict):
            logged = entry["logged"] = {}
        return logged

    def log(self, values: Mapping[str, float], step: int) -> None:
        if self.backend is None:
            return
        fresh = {k: float(v) for k, v in values.items() if step > self.logged.get(k, -1)}
        if not fresh:
            return
        try:
            self.backend.log(fresh, step)
        except Exception as e:  # noqa: BLE001 - a tracker never stops training
            self._off("stopped logging", e)
            return
        if self.once:
            self.logged.update(dict.fromkeys(fresh, step))
            self.state.save()

    def close(self, finished: bool = True) -> None:
        """Idempotent, and never raises: it runs on the way out of a stop or a failure."""
        backend, self.backend = self.backend, None
        if backend is None:
            return
        try:
            backend.close(finished)
        except Exception as e:  # noqa: BLE001
            say(f"tracker {self.name}: closing it failed ({reason_of(e)}); its run keeps what it received")

    def _off(self, what: str, e: BaseException) -> None:
        say(f"tracker {self.name} {what} ({reason_of(e)}); it is off for the rest of this start, metrics.jsonl has "
            "every record")
        backend, self.backend = self.backend, None
        if backend is not None:
            try:
                backend.close(False)
            except Exception:  # noqa: BLE001 - already reported why
                pass


def reason_of(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__
