"""Experiment trackers for the shared trainer's metrics: TensorBoard, Weights & Biases, MLflow (`--tracker`).
RUN/metrics.jsonl is the Meter's own and always written; these are extras, each imported only on rank 0 and only
when asked for, so this module and the trainer run without any of their packages.

Rank 0 only: the Meter opens them there (`open_trackers`) and logs what it already averaged over all ranks. Every
rank checks first that the packages are installed (`require`), so a missing one refuses the start on all ranks with
one line (a ConfigError: exit 2) instead of failing rank 0 alone while the others wait in a collective.

One tracker run per training run, across requeues and resumes: the first start that uses a tracker creates its run
and records the id in RUN/tracker.json (atomically, before it logs anything); every later start in that run folder
reads it and goes on logging into that run (wandb: `wandb.init(id=..., resume="allow")`; mlflow: the run set back
to RUNNING). A start that cannot reach the recorded run says so and trains without that tracker: a new run would
split the history, and a tracker is not worth stopping a training run for.

Where the data goes without a server:
- wandb: its files under RUN/wandb. WANDB_MODE wins when set; without it and without W&B credentials
  (WANDB_API_KEY, WANDB_IDENTITY_TOKEN_FILE, or ~/.netrc's entry that `wandb login` writes) it logs offline rather
  than fail the start on a compute node, and says so: `wandb sync RUN/wandb/offline-run-*` uploads it later. The
  project is WANDB_PROJECT, else the job's name; the run's name is the run folder's. Its console capture is off (the
  rank logs are RUN/logs). wandb's service process (wandb-core) dies of SIGTERM: under a preemption that sends
  SIGTERM rather than the profile's signal, what rank 0 logs after it is lost for wandb (metrics.jsonl has it).
- mlflow: MLFLOW_TRACKING_URI when set; else a file store in RUN/mlruns (`mlflow ui --backend-store-uri RUN/mlruns`).
  mlflow-skinny has no database backend (sqlite needs sqlalchemy, alembic and sqlparse, which the full `mlflow`
  package brings), and MLflow 3.x refuses the file store unless MLFLOW_ALLOW_FILE_STORE=true, which rank 0 sets
  for itself when it picks that store. The experiment is MLFLOW_EXPERIMENT_NAME, else the job's name (RUN/spec.json's
  "name", else the run folder's); the run's name is the run folder's.
- tensorboard: RUN/tensorboard, through torch.utils.tensorboard (needs the tensorboard package).

The run's config, logged once per tracker run (not again on a resume): {"spec": RUN/spec.json as submitted (with the
git state it records), "trainer": the resolved TrainConfig}. wandb: the run's config; mlflow: params (flattened,
values of up to 500 characters) and the whole as the artifact config.json; tensorboard: a text summary.

Steps logged twice. A start resumes from the last checkpoint, so the steps a killed or failed start logged after it
are logged again (metrics.jsonl drops the earlier lines: the new ones win). wandb drops a step below its
run's current one (online, with a warning per call; offline both would reach the run file and a later sync), and
mlflow keeps both values of a step. So for those two, rank 0 records each metric's last logged step in
RUN/tracker.json and does not log a step again: each step appears once, with the value first logged (the same loss
and val_loss after an exact resume; only the throughput differs). A crash between a log and that record logs at most
that one interval twice. TensorBoard instead hides the earlier start's events from the resumed step on (its
`purge_step`), so it shows the new values, like metrics.jsonl.

A start that ends before the run does (a stop, a failure) leaves its tracker runs as mlflow KILLED and wandb
preempting with exit code 1; the start that reaches the last step leaves them FINISHED / finished. A stop closes them
after its checkpoint and before it requeues the job, so wandb's finish waits at most WANDB_FINISH_TIMEOUT_S for its
upload (the rest stays in RUN/wandb for `wandb sync`).

A tracker that fails while training (a server gone, wandb-core killed) is turned off for the rest of the start with
one line in rank 0's log; training goes on and metrics.jsonl keeps every record. An mlflow server that does not
answer holds that one log call for mlflow's HTTP retries first (MLFLOW_HTTP_REQUEST_MAX_RETRIES, minutes by default).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import netrc
import os
import re
import secrets
import string
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from hpcjobs.protocol.runfolder import RunFolder, read_json, write_json_atomic
from hpcjobs.protocol.trainconfig import TRACKERS
from hpcjobs.protocol.trainflags import ConfigError

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
"""Each tracker's module, whose absence `require` reports; its pip extra of hpcjobs has the tracker's name."""
WANDB_FINISH_TIMEOUT_S = 30.0
"""The longest a wandb run's finish waits for its upload (see wandb_settings)."""
PARAM_CHARS = 500
"""The longest config value logged as an mlflow param (the store's limit is 6000); longer ones (a git diff) are in
the config.json artifact only."""


class TrackerUnavailable(ConfigError):
    """A tracker asked for whose package this Python lacks: one line, the pip extra that installs it."""


class Tracker(Protocol):
    """What the Meter logs to: `values` of one step; `close(finished=False)` when the start ends before the run does
    (a stop, a failure), which mlflow and wandb record as the run's state."""

    name: str

    def log(self, values: Mapping[str, float], step: int) -> None: ...

    def close(self, finished: bool = True) -> None: ...


def say(message: str) -> None:
    print(f"[hpcjobs rank 0] {message}", flush=True)


# --- packages ---------------------------------------------------------------------------------------------------

def require(names: tuple[str, ...] | list[str]) -> None:
    """Raise TrackerUnavailable for the first tracker in `names` whose package is not installed. Finds the module
    without importing it: every rank calls this, and only rank 0 imports."""
    for name in names:
        module = PACKAGES.get(name)
        if module is not None and not _installed(module):
            raise _unavailable(name, module)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken install, or a module object without a spec
        return False


def _import(name: str) -> Any:
    """The tracker's package, or TrackerUnavailable when it cannot be imported."""
    module = PACKAGES[name]
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise _unavailable(name, module, f" ({type(e).__name__}: {e})") from None


def _unavailable(name: str, module: str, why: str = "") -> TrackerUnavailable:
    import sys

    return TrackerUnavailable(f"--tracker {name}: the {module} package is not installed in {sys.executable}{why}; "
                              f"valid: --tracker {'|'.join(TRACKERS)} with each one's package installed. HINT: pip "
                              f"install 'hpcjobs[{name}]' into the environment the ranks run in, or drop {name} from "
                              "--tracker")


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

class Backend(Protocol):
    def log(self, values: Mapping[str, float], step: int) -> None: ...

    def close(self, finished: bool) -> None: ...


class Guarded:
    """A tracker as the Meter sees it: steps already in the tracker's run are not logged again (when `once`), each
    log is recorded in RUN/tracker.json, and the first failure turns the tracker off for the rest of the start."""

    def __init__(self, name: str, backend: Backend, state: TrackerFile, once: bool) -> None:
        self.name, self.state, self.once = name, state, once
        self.backend: Backend | None = backend
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
            say(f"tracker {self.name}: closing it failed ({_why(e)}); its run keeps what it received")

    def _off(self, what: str, e: BaseException) -> None:
        say(f"tracker {self.name} {what} ({_why(e)}); it is off for the rest of this start, metrics.jsonl has "
            "every record")
        backend, self.backend = self.backend, None
        if backend is not None:
            try:
                backend.close(False)
            except Exception:  # noqa: BLE001 - already reported why
                pass


def _why(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__


class WandbTracker:
    """One wandb run per training run: its id is chosen here (W&B's own alphabet) and recorded before `wandb.init`,
    so a start that dies inside init still leaves the id the next start resumes."""

    def __init__(self, run: RunFolder, state: TrackerFile, job: Job, config: dict[str, Any]) -> None:
        wandb = _import("wandb")
        entry = state.entry("wandb")
        if not isinstance(entry.get("id"), str):
            entry["id"] = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(12))
            state.save()
        mode = wandb_mode(os.environ)
        if mode is not None:
            say(f"tracker wandb: no WANDB_MODE and no W&B credentials: logging offline into {run.path / 'wandb'} "
                f"(upload with `wandb sync {run.path / 'wandb'}/offline-run-*`, or set WANDB_MODE=online)")
        first = not entry.get("config_logged")
        self.run = wandb.init(id=entry["id"], resume="allow", dir=str(run.path),
                              project=os.environ.get("WANDB_PROJECT") or wandb_project(job.name),
                              name=job.run_name, config=config if first else None, mode=mode,
                              settings=wandb_settings(wandb))
        if first:
            entry["config_logged"] = True
            state.save()

    def log(self, values: Mapping[str, float], step: int) -> None:
        self.run.log(dict(values), step=step)

    def close(self, finished: bool) -> None:
        """A start that ends before the run does marks it preempting and exits non-zero: W&B shows it preempted,
        not finished, until the next start resumes it."""
        if not finished:
            self.run.mark_preempting()
        self.run.finish(exit_code=0 if finished else 1)


def wandb_settings(wandb: Any) -> Any:
    """Console capture off (the rank logs are RUN/logs), and `finish` bounded: a stop closes the trackers after its
    checkpoint and before it requeues the job, within the time the profile's signal leaves; what is not uploaded by
    then stays in RUN/wandb for `wandb sync`. A wandb without finish_timeout (older ones) blocks until uploaded."""
    try:
        return wandb.Settings(console="off", finish_timeout=WANDB_FINISH_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - an older wandb refuses the unknown setting
        return wandb.Settings(console="off")


def wandb_mode(environ: Mapping[str, str]) -> str | None:
    """"offline" when nothing says how to reach W&B (no WANDB_MODE, no credentials): wandb would otherwise fail the
    start asking for a login on a compute node that cannot answer. None: wandb decides (WANDB_MODE, or online)."""
    if any(environ.get(v) for v in ("WANDB_MODE", "WANDB_DISABLED", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE")):
        return None
    host = urllib.parse.urlparse(environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or ""
    path = environ.get("NETRC") or str(Path(environ.get("HOME") or Path.home()) / ".netrc")
    try:
        found = netrc.netrc(path).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        found = None
    return None if found else "offline"


def wandb_project(name: str) -> str:
    """W&B refuses project names with /, \\, #, ?, %, : and over 128 characters."""
    return re.sub(r"[/\\#?%:\s]+", "-", name)[:128] or "hpcjobs"


class MlflowTracker:
    """One mlflow run per training run, in the tracking store this start is given (see the module's docstring)."""

    def __init__(self, run: RunFolder, state: TrackerFile, job: Job, config: dict[str, Any]) -> None:
        _import("mlflow")
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        self.metric = Metric
        uri = os.environ.get("MLFLOW_TRACKING_URI") or self.local_store(run)
        self.client = MlflowClient(tracking_uri=uri)
        entry = state.entry("mlflow")
        if isinstance(entry.get("run_id"), str):
            self.run_id = self.reopen(entry, uri)
        else:
            self.run_id = self.create(job, os.environ.get("MLFLOW_EXPERIMENT_NAME") or job.name, run)
            entry.update(run_id=self.run_id, store=uri)
            state.save()
        if not entry.get("config_logged"):
            self.log_config(config)
            entry["config_logged"] = True
            state.save()

    @staticmethod
    def local_store(run: RunFolder) -> str:
        """RUN/mlruns as a file store, from the run folder's path at this start (a moved run folder still finds
        it); MLflow 3.x wants MLFLOW_ALLOW_FILE_STORE for it."""
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        return (run.path / "mlruns").resolve().as_uri()

    def reopen(self, entry: dict[str, Any], uri: str) -> str:
        run_id = str(entry["run_id"])
        try:
            self.client.update_run(run_id, status="RUNNING")
        except Exception as e:
            raise RuntimeError(f"RUN/tracker.json names mlflow run {run_id} (created in {entry.get('store')}), which "
                               f"the tracking store {uri} does not give back ({_why(e)}). HINT: set "
                               "MLFLOW_TRACKING_URI as in the first start; to start a new mlflow run instead, delete "
                               "the mlflow entry of RUN/tracker.json") from e
        return run_id

    def create(self, job: Job, experiment: str, run: RunFolder) -> str:
        found = self.client.get_experiment_by_name(experiment)
        if found is not None:
            experiment_id = found.experiment_id
        else:
            try:
                experiment_id = self.client.create_experiment(experiment)
            except Exception:  # another job created it in between
                again = self.client.get_experiment_by_name(experiment)
                if again is None:
                    raise
                experiment_id = again.experiment_id
        made = self.client.create_run(experiment_id, run_name=job.run_name,
                                      tags={"hpcjobs.run_dir": str(run.path.resolve())})
        return str(made.info.run_id)

    def log_config(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(k, v) for k, v in flat_params(config).items()]
        for i in range(0, len(params), 100):  # log_batch takes at most 100 params
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        self.client.log_dict(self.run_id, config, "config.json")

    def log(self, values: Mapping[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[self.metric(k, v, now, step) for k, v in values.items()])

    def close(self, finished: bool) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if finished else "KILLED")


def flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config as mlflow params: `trainer.lr` → "0.0003"; values longer than PARAM_CHARS are left out, and
    characters mlflow refuses in keys become `_`."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = re.sub(r"[^\w\-. :/]", "_", f"{prefix}{key}")
        if isinstance(value, Mapping):
            out.update(flat_params(value, f"{name}."))
            continue
        text = value if isinstance(value, str) else json.dumps(value)
        if len(text) <= PARAM_CHARS and len(name) <= 250:
            out[name] = text
    return out


class TensorBoardTracker:
    """Scalars in RUN/tensorboard, all starts in one folder: TensorBoard hides an earlier start's events from the
    resumed step on (`purge_step`), so a step shows the value of the start that kept it."""

    def __init__(self, run: RunFolder, state: TrackerFile, job: Job, config: dict[str, Any],
                 start_step: int) -> None:
        _import("tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run.path / "tensorboard"), purge_step=start_step + 1)
        entry = state.entry("tensorboard")
        if not entry.get("config_logged"):
            self.writer.add_text("config", f"```\n{json.dumps(config, indent=1, sort_keys=True)}\n```", 0)
            entry["config_logged"] = True
            state.save()

    def log(self, values: Mapping[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def close(self, finished: bool) -> None:
        self.writer.close()


# --- opening them -----------------------------------------------------------------------------------------------

def open_trackers(names: tuple[str, ...] | list[str], run: RunFolder, config: dict[str, Any],
                  start_step: int = 0) -> list[Tracker]:
    """Rank 0's trackers for `names` (jsonl is the Meter's own and skipped), each continuing this run folder's
    tracker run. `config` is the resolved trainer config; the run's config is it with RUN/spec.json. `start_step`:
    the step this start resumes from. Raises TrackerUnavailable for a missing package; any other failure to open
    one is one line in the log and that tracker is off for this start."""
    require(names)
    state, job = TrackerFile(run), Job.of(run)
    run_config = {"spec": job.spec, "trainer": config}
    opened: list[Tracker] = []
    for name in names:
        make = _makers(start_step).get(name)
        if make is None:
            continue
        try:
            backend = make(run, state, job, run_config)
        except TrackerUnavailable:
            raise
        except Exception as e:  # noqa: BLE001 - a tracker never stops training
            say(f"tracker {name} could not start ({_why(e)}); it is off for this start, metrics.jsonl has every "
                "record")
            continue
        opened.append(Guarded(name, backend, state, once=name != "tensorboard"))
    return opened


Maker = Callable[[RunFolder, TrackerFile, Job, dict[str, Any]], Backend]


def _makers(start_step: int) -> dict[str, Maker]:
    def tensorboard(run: RunFolder, state: TrackerFile, job: Job, config: dict[str, Any]) -> Backend:
        return TensorBoardTracker(run, state, job, config, start_step)

    return {"wandb": WandbTracker, "mlflow": MlflowTracker, "tensorboard": tensorboard}
