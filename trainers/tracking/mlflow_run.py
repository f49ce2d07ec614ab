"""MLflow: one mlflow run per training run, in MLFLOW_TRACKING_URI or a file store in the run folder (see
trainers/tracking/__init__.py)."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Mapping
from typing import Any

from hpcjobs.protocol.runfolder import RunFolder
from trainers.tracking.common import Job, TrackerFile, import_package, reason_of

PARAM_CHARS = 500
"""The longest config value logged as an mlflow param (the store's limit is 6000); longer ones (a git diff) are in
the config.json artifact only."""


class MlflowTracker:
    """One mlflow run per training run, in the tracking store this start is given (see the module's docstring)."""

    def __init__(self, run: RunFolder, state: TrackerFile, job: Job, config: dict[str, Any]) -> None:
        import_package("mlflow")
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
                               f"the tracking store {uri} does not give back ({reason_of(e)}). HINT: set "
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


LOGS_ONCE = True
"""Whether a step already in the tracker's run is left out on a resume (mlflow keeps both values of a step)."""


def open_run(run: RunFolder, state: TrackerFile, job: Job, config: dict[str, Any],
             start_step: int) -> MlflowTracker:
    return MlflowTracker(run, state, job, config)
