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
from collections.abc import Mapping
from typing import Any, Protocol

from hpcjobs.protocol.runfolder import RunFolder
from hpcjobs.protocol.settings.trainconfig import TRACKERS
from trainers.tracking.common import Guarded, Job, TrackerFile, TrackerUnavailable, reason_of, require, say

__all__ = ["Guarded", "Tracker", "TrackerFile", "TrackerUnavailable", "open_trackers", "require"]


class Tracker(Protocol):
    """What the Meter logs to: `values` of one step; `close(finished=False)` when the start ends before the run does
    (a stop, a failure), which mlflow and wandb record as the run's state."""

    name: str

    def log(self, values: Mapping[str, float], step: int) -> None: ...

    def close(self, finished: bool = True) -> None: ...


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
        if TRACKERS.get(name) is None:  # jsonl: the Meter's own
            continue
        module = importlib.import_module(f"trainers.tracking.{name}_run")
        try:
            backend = module.open_run(run, state, job, run_config, start_step)
        except TrackerUnavailable:
            raise
        except Exception as e:  # noqa: BLE001 - a tracker never stops training
            say(f"tracker {name} could not start ({reason_of(e)}); it is off for this start, metrics.jsonl has every "
                "record")
            continue
        opened.append(Guarded(name, backend, state, once=module.LOGS_ONCE))
    return opened
