"""Experiment trackers across a requeue on the real test cluster (issue 14): a 2-node job logging to wandb (offline)
and mlflow (its file store in the run folder) is stopped by the profile's signal, requeues itself, and finishes; both
trackers hold one run with every logged step once, written by rank 0 alone. The same reading of the trackers' files
as tests/test_tracking.py (which shows it locally, after a failure)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import REPO, hpcjobs, slurm, wait_for_state, wait_for_step
from test_tracking import NO_NETWORK, wandb_starts

pytestmark = pytest.mark.cluster
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
STEPS = 400


def test_wandb_and_mlflow_continue_one_run_across_a_requeue(cluster_profile: Path, shared_tmp: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    run = shared_tmp / "runs" / "tracked"
    env = [f"--env={k}={v}" for k, v in {**NO_NETWORK, "WANDB_CONFIG_DIR": str(shared_tmp / "wandb-config"),
                                          "WANDB_CACHE_DIR": str(shared_tmp / "wandb-cache"),
                                          "WANDB_DATA_DIR": str(shared_tmp / "wandb-data")}.items()]
    out = hpcjobs("submit", "--profile", str(cluster_profile), "--nodes", "2", "--gpus", "1", "--time", "10:00",
                  "--json", "--run-dir", str(run), *env, "trainers.tasks.lm", "--size", "tiny", "--steps", str(STEPS),
                  "--log-every", "10", "--ckpt-every", "100", "--tracker", "wandb,mlflow", cwd=REPO)
    assert out.returncode == 0, out.stderr
    job = json.loads(out.stdout)["job_id"]
    wait_for_step(run, 150, timeout=300)
    slurm("scancel", "--signal=USR2", job)  # the profile's stop signal: save, close the trackers, requeue
    assert wait_for_state(job, DONE, timeout=400) == "COMPLETED"
    starts = [json.loads(ln) for ln in (run / "restarts.jsonl").read_text().splitlines() if "stopped" not in ln]
    assert len(starts) == 2, starts
    ids = json.loads((run / "tracker.json").read_text())
    logged = wandb_starts(run)
    assert [s["ids"] for s in logged] == [{ids["wandb"]["id"]}] * 2, "one wandb run, continued by the restart"
    stops = [json.loads(ln)["step"] for ln in (run / "restarts.jsonl").read_text().splitlines() if "stopped" in ln]
    expected = sorted({*range(10, STEPS + 1, 10), *stops})  # a stop logs the steps since the last log too
    steps = [step for s in logged for step in s["history"]]
    assert sorted(steps) == expected, "every logged step once"

    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(run / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("lm")
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.run_id for r in runs] == [ids["mlflow"]["run_id"]] and runs[0].info.status == "FINISHED"
    history = client.get_metric_history(ids["mlflow"]["run_id"], "loss")
    assert sorted(m.step for m in history) == expected
