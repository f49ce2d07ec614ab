"""Experiment trackers (issue 14): `--tracker wandb,mlflow` on the local profile, 2 ranks, a start that fails at step
8 (its last checkpoint is step 6, so step 7 is logged twice) and a second start in the same run folder: ONE wandb run
and ONE mlflow run hold steps 1..12 once each, written by rank 0 alone, with the run's config. wandb runs offline and
mlflow in its file store in the run folder: no network. Plus the flag's checks, the missing-package line, and which
steps a resumed tracker logs again."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import urllib.parse
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO, hpcjobs
from hpcjobs.protocol.runfolder import RunFolder
from hpcjobs.protocol.settings.trainconfig import PIP_NAMES, TrainConfig
from hpcjobs.protocol.settings.trainflags import ConfigError, parse_trainer_args
from trainers import tracking
from trainers.tracking import mlflow_run, wandb_run

STEPS = 12
ARGS = ["trainers.tasks.lm", "--size", "tiny", "--steps", str(STEPS), "--log-every", "1", "--ckpt-every", "3",
        "--eval-every", "4", "--tracker", "wandb,mlflow"]
NO_NETWORK = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_ERROR_REPORTING": "false",
              "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"}
FOREIGN = ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_API_KEY", "WANDB_PROJECT", "WANDB_DIR")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One run folder trained in two starts: the first fails after step 8 on every rank, the second finishes."""
    base = tmp_path_factory.mktemp("tracking")
    folder = base / "run"
    env = {**NO_NETWORK, "HPCJOBS_HOME": str(base / "home"), "WANDB_CONFIG_DIR": str(base / "wandb-config"),
           "WANDB_CACHE_DIR": str(base / "wandb-cache"), "WANDB_DATA_DIR": str(base / "wandb-data")}
    with pytest.MonkeyPatch.context() as mp:
        for name in FOREIGN:
            mp.delenv(name, raising=False)
        first = hpcjobs("submit", "--profile", "local", "--gpus", "2", "--run-dir", str(folder), *ARGS, cwd=REPO,
                        env={**env, "HPCJOBS_FAULT_INJECT": "step@8", "HPCJOBS_FAULT_ACTION": "raise"}, timeout=300)
        assert first.returncode != 0 and "injected at step@8" in first.stdout + first.stderr
        ids = json.loads((folder / "tracker.json").read_text())
        again = hpcjobs("submit", "--profile", "local", "--gpus", "2", "--run-dir", str(folder), *ARGS, cwd=REPO,
                        env={**env, "HPCJOBS_FAULT_INJECT": ""}, timeout=300)
        assert again.returncode == 0, again.stdout + again.stderr
        assert "[hpcjobs rank 0] tracker" not in again.stdout + again.stderr, again.stdout  # none turned off
        after = json.loads((folder / "tracker.json").read_text())
        assert (after["wandb"]["id"], after["mlflow"]["run_id"]) == (ids["wandb"]["id"], ids["mlflow"]["run_id"])
        mp.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # for the tests' own reading of RUN/mlruns
        yield folder


def jsonl_losses(folder: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


# --- wandb (offline): its run files are LevelDB-style logs of protobuf records --------------------------------------

def wandb_records(path: Path) -> Iterator[Any]:
    """The records of a run's .wandb file: a 7-byte header, then 32 KiB blocks of chunks (crc32, length, type:
    1 whole, 2 first, 3 middle, 4 last), a block's tail under 7 bytes left as padding."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", path
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (length == 0 and kind == 0):
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_starts(folder: Path) -> list[dict[str, Any]]:
    """Per offline run folder (one per start of rank 0), oldest first: its run id, config and history by step."""
    starts = []
    for run_dir in sorted((folder / "wandb").glob("offline-run-*")):
        (file,) = run_dir.glob("*.wandb")
        found: dict[str, Any] = {"ids": set(), "config": {}, "history": {}}
        for record in wandb_records(file):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                found["ids"].add(record.run.run_id)
                found["config"].update({i.key: json.loads(i.value_json) for i in record.run.config.update})
            elif kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                found["history"].setdefault(record.history.step.num, []).append(items)
        starts.append(found)
    return starts


@pytest.mark.train
def test_wandb_keeps_one_run_across_the_restart_written_by_rank_0_only(run: Path) -> None:
    starts = wandb_starts(run)
    assert len(starts) == 2, "one wandb run folder per start: rank 1 opened none"
    run_id = json.loads((run / "tracker.json").read_text())["wandb"]["id"]
    assert [s["ids"] for s in starts] == [{run_id}, {run_id}]
    logged = {step: rows for s in starts for step, rows in s["history"].items()}
    assert sorted(step for s in starts for step in s["history"]) == list(range(1, STEPS + 1)), "each step once"
    assert max(starts[0]["history"]) == 7 and min(starts[1]["history"]) == 8  # step 7 was not logged again
    losses = jsonl_losses(run)
    for step, rows in logged.items():
        (row,) = rows
        assert row["loss"] == pytest.approx(losses[step], rel=1e-6) and {"lr", "samples_per_s"} <= set(row)
    assert sorted(step for step, rows in logged.items() if "val_loss" in rows[0]) == [4, 8, 12]
    config = starts[0]["config"]
    assert config["trainer"] == TrainConfig(**config["trainer"]).as_dict()
    assert (config["trainer"]["steps"], config["trainer"]["tracker"], config["spec"]["name"]) == (
        STEPS, "wandb,mlflow", "lm")
    assert "trainer" not in starts[1]["config"]  # logged once, not again on the resume


# --- mlflow (file store in RUN/mlruns) ------------------------------------------------------------------------------

@pytest.mark.train
def test_mlflow_keeps_one_run_across_the_restart_written_by_rank_0_only(run: Path) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("lm")  # the job's name from spec.json
    assert experiment is not None
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.run_id for r in runs] == [json.loads((run / "tracker.json").read_text())["mlflow"]["run_id"]]
    run_id = runs[0].info.run_id
    history = client.get_metric_history(run_id, "loss")
    assert sorted(m.step for m in history) == list(range(1, STEPS + 1)), "each step once: rank 0 alone, no re-log"
    losses = jsonl_losses(run)
    assert all(m.value == pytest.approx(losses[m.step], rel=1e-6) for m in history)
    assert sorted(m.step for m in client.get_metric_history(run_id, "val_loss")) == [4, 8, 12]
    assert runs[0].info.status == "FINISHED" and runs[0].info.run_name == "run"
    params = runs[0].data.params
    assert (params["trainer.steps"], params["trainer.tracker"], params["spec.name"]) == ("12", "wandb,mlflow", "lm")
    assert all(len(value) <= mlflow_run.PARAM_CHARS for value in params.values())  # longer ones: config.json only
    artifacts = Path(urllib.parse.urlparse(runs[0].info.artifact_uri).path)
    config = json.loads((artifacts / "config.json").read_text())
    assert config["trainer"]["steps"] == STEPS and config["spec"]["name"] == "lm"


# --- the flag ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("given,said", [("neptune", "--tracker 'neptune': 'neptune' is not a choice"),
                                        ("wandb,comet,x", "--tracker 'wandb,comet,x': 'comet', 'x' are not choices"),
                                        (" , ", "--tracker ' , ' names none")])
def test_an_unknown_tracker_is_one_line_with_the_valid_names(given: str, said: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_trainer_args(["--tracker", given])
    text = str(e.value)
    assert "\n" not in text and text.startswith(f"{said}; valid: ")
    assert "valid: --tracker jsonl|tensorboard|wandb|mlflow, or several joined by commas. HINT: " in text


def test_trackers_are_a_comma_list_kept_in_order_once_each() -> None:
    assert TrainConfig().tracker == "jsonl" and TrainConfig().trackers() == ("jsonl",)
    cfg, rest = parse_trainer_args(["--tracker", "wandb, mlflow,wandb", "--size", "tiny"])
    assert (cfg.tracker, cfg.trackers(), rest) == ("wandb,mlflow", ("wandb", "mlflow"), ["--size", "tiny"])
    assert parse_trainer_args(["--tracker=tensorboard"])[0].trackers() == ("tensorboard",)
    assert parse_trainer_args(["--tensorboard"])[1] == ["--tensorboard"]  # the old switch is gone: the task's


# --- a missing package ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["wandb", "mlflow", "tensorboard"])
def test_a_missing_tracker_package_names_its_pip_extra(name: str, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, name, None)  # `import name` raises ImportError; find_spec finds nothing
    with pytest.raises(tracking.TrackerUnavailable) as e:
        tracking.open_trackers(["jsonl", name], RunFolder(tmp_path), {})
    text = str(e.value)
    assert isinstance(e.value, ConfigError) and "\n" not in text
    assert text.startswith(f"--tracker {name}: the {name} package is not installed in ")
    assert f"HINT: pip install {PIP_NAMES.get(name, name)} into the environment the ranks run in" in text
    assert not (tmp_path / "tracker.json").exists()


@pytest.mark.train
def test_a_rank_without_the_package_refuses_the_start_in_one_line(tmp_path: Path) -> None:
    """Every rank checks before it trains (exit 2, nothing recorded as the run's end), not rank 0 alone."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['wandb'] = None\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HPCJOBS_"))}
    out = subprocess.run([sys.executable, "-m", "trainers", "trainers.tasks.classifier", "--steps", "2",
                          "--run-dir", str(tmp_path / "r"), "--tracker", "jsonl,wandb"], capture_output=True,
                         text=True, cwd=REPO, env={**env, "PYTHONPATH": f"{hide}:{REPO}"}, timeout=300)
    assert out.returncode == 2, out.stdout + out.stderr
    log = (tmp_path / "r" / "logs" / "restart-0" / "rank-0.log").read_text()
    assert "hpcjobs: --tracker wandb: the wandb package is not installed" in log and "Traceback" not in log
    assert "pip install wandb" in log
    assert not (tmp_path / "r" / "final.json").exists() and not (tmp_path / "r" / "metrics.jsonl").exists()


# --- what a resumed tracker logs --------------------------------------------------------------------------------

class Recorder:
    def __init__(self, fail_at: int | None = None) -> None:
        self.logged: list[tuple[int, dict[str, float]]] = []
        self.closed: list[bool] = []
        self.fail_at = fail_at

    def log(self, values: Mapping[str, float], step: int) -> None:
        if step == self.fail_at:
            raise ConnectionResetError("Connection lost")
        self.logged.append((step, dict(values)))

    def close(self, finished: bool) -> None:
        self.closed.append(finished)


def test_a_resumed_tracker_logs_no_step_twice_per_metric(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path)
    first = Recorder()
    tracker = tracking.Guarded("mlflow", first, tracking.TrackerFile(folder), once=True)
    for step in range(1, 8):
        tracker.log({"loss": float(step)}, step)
        if step % 4 == 0:
            tracker.log({"val_loss": float(step)}, step)
    # killed here: never closed. The next start resumes from a checkpoint at step 2 and logs 3.. again.
    second = Recorder()
    tracker = tracking.Guarded("mlflow", second, tracking.TrackerFile(folder), once=True)
    for step in range(3, 10):
        tracker.log({"loss": step + 0.5, "lr": 0.1}, step)
        if step % 4 == 0:
            tracker.log({"val_loss": step + 0.5}, step)
    tracker.close(finished=True)
    tracker.close(finished=True)
    assert [s for s, _ in second.logged] == [3, 4, 5, 6, 7, 8, 8, 9]
    assert second.logged[0] == (3, {"lr": 0.1}) and second.logged[5] == (8, {"loss": 8.5, "lr": 0.1})
    assert second.closed == [True]
    state = json.loads(folder.tracker.read_text())["mlflow"]["logged"]
    assert state == {"loss": 9, "lr": 9, "val_loss": 8}


def test_a_failing_tracker_is_turned_off_with_one_line_and_training_goes_on(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    backend = Recorder(fail_at=3)
    tracker = tracking.Guarded("wandb", backend, tracking.TrackerFile(RunFolder(tmp_path)), once=True)
    for step in range(1, 6):
        tracker.log({"loss": 1.0}, step)
    tracker.close(finished=True)
    said = capsys.readouterr().out.strip().splitlines()
    assert said == ["[hpcjobs rank 0] tracker wandb stopped logging (ConnectionResetError: Connection lost); it is "
                    "off for the rest of this start, metrics.jsonl has every record"]
    assert [s for s, _ in backend.logged] == [1, 2] and backend.closed == [False]


def test_wandb_goes_offline_only_when_nothing_says_how_to_reach_it(tmp_path: Path) -> None:
    home = {"HOME": str(tmp_path)}
    assert wandb_run.wandb_mode(home) == "offline"
    assert wandb_run.wandb_mode({**home, "WANDB_MODE": "online"}) is None
    assert wandb_run.wandb_mode({**home, "WANDB_API_KEY": "k" * 40}) is None
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    (tmp_path / ".netrc").chmod(0o600)
    assert wandb_run.wandb_mode(home) is None  # `wandb login` wrote it
    assert wandb_run.wandb_mode({**home, "WANDB_BASE_URL": "https://wandb.example.org"}) == "offline"


def test_tensorboard_shows_the_resumed_starts_values_from_its_step_on(tmp_path: Path) -> None:
    """Skipped without the tensorboard package (not in the dev extra): `pip install tensorboard`."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder = RunFolder(tmp_path)
    for start, steps in ((0, range(1, 8)), (5, range(6, 11))):  # killed after step 7, resumed from step 5
        (tracker,) = tracking.open_trackers(["tensorboard"], folder, {"lr": 1.0}, start_step=start)
        for step in steps:
            tracker.log({"loss": step + start / 10}, step)
        tracker.close(finished=False)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, round(e.value, 2)) for e in events.Scalars("loss")] == [
        (1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 5.0), (6, 6.5), (7, 7.5), (8, 8.5), (9, 9.5), (10, 10.5)]
