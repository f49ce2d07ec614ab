"""`hpcjobs compare`: a sweep's runs side by side from their run folders, and --plot's loss curves (issue 14)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import BIN, REPO
from hpcjobs.cli import main
from hpcjobs.goodput import compare, plot
from hpcjobs.jobs.store import JobRecord, JobStore

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_lines(path: Path, records: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def make_run(path: Path, point: dict[str, str] | None, metrics: list[dict[str, Any]] | None = None,
             restarts: list[dict[str, Any]] | None = None, final: dict[str, Any] | None = None) -> Path:
    """A run folder as a sweep task leaves it: spec.json with its point, and whatever it got to write."""
    path.mkdir(parents=True)
    (path / "spec.json").write_text(json.dumps({"name": "lm", "point": point}))
    if metrics is not None:
        write_lines(path / "metrics.jsonl", metrics)
    if restarts is not None:
        write_lines(path / "restarts.jsonl", restarts)
    if final is not None:
        (path / "final.json").write_text(json.dumps(final))
    return path


@pytest.fixture
def sweep(tmp_path: Path) -> dict[str, Path]:
    """Three points of a sweep: one finished after a preemption (evaluated; the resumed start logged step 30 again),
    one stopped at a checkpoint (never evaluated; its first start's lowest loss was logged again, higher), and one
    with a spec but no metrics yet."""
    t = time.time() - 100
    finished = make_run(
        tmp_path / "sweep" / "0", {"lr": "1e-3", "seed": "1"},
        metrics=[{"step": 10, "loss": 10.0, "restart": 0}, {"step": 20, "loss": 8.0, "restart": 0},
                 {"step": 20, "val_loss": 6.0, "restart": 0}, {"step": 30, "loss": 7.0, "restart": 0},
                 {"step": 30, "loss": 9.0, "restart": 1}, {"step": 40, "loss": 5.0, "restart": 1},
                 {"step": 40, "val_loss": 4.5, "restart": 1}],
        restarts=[{"time": t, "restart": 0, "job_id": "77_0", "world_size": 2},
                  {"time": t + 1, "restart": 0, "stopped": "preemption", "step": 20},
                  {"time": t + 2, "restart": 1, "job_id": "77_0", "world_size": 2}],
        final={"state": "finished", "reason": "done", "step": 40, "time": t + 3, "job_id": "77_0"})
    stopped = make_run(
        tmp_path / "sweep" / "1", {"lr": "3e-4", "seed": "1"},
        metrics=[{"step": 10, "loss": 4.0, "restart": 0}, {"step": 20, "loss": 0.5, "restart": 0},
                 {"step": 20, "loss": 3.0, "restart": 1}, {"step": 30, "loss": 2.0, "restart": 1}],
        restarts=[{"time": t, "restart": 0, "job_id": "77_1", "world_size": 2},
                  {"time": t + 1, "restart": 0, "stopped": "preemption", "step": 10},
                  {"time": t + 2, "restart": 1, "job_id": "77_1", "world_size": 2},
                  {"time": t + 3, "restart": 1, "stopped": "interrupt", "step": 30}])
    pending = make_run(tmp_path / "sweep" / "2", {"lr": "1e-4"})
    return {"finished": finished, "stopped": stopped, "pending": pending}


def table_of(text: str) -> list[list[str]]:
    return [re.split(r"\s{2,}", line.strip()) for line in text.splitlines()]


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["compare", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_table_has_a_row_per_point_in_sweep_order(sweep: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, *(str(p) for p in sweep.values()))
    assert code == 0
    header, *rows = table_of(out)
    assert header == ["lr", "seed", "run", "job", "state", "steps", "restarts", "last loss", "best (metric)", "ETTR"]
    # by lr's value (1e-4 < 3e-4 < 1e-3), which text order gets wrong; a key a run lacks is '-'
    assert rows == [
        ["1e-4", "-", str(sweep["pending"]), "-", "UNKNOWN", "-", "0", "-", "-", "-"],
        ["3e-4", "1", str(sweep["stopped"]), "-", "STOPPED", "30", "1", "2.0000", "2.0000 (loss)", "-"],
        ["1e-3", "1", str(sweep["finished"]), "-", "COMPLETED", "40", "1", "5.0000", "4.5000 (val_loss)", "-"],
    ]


def test_repeated_steps_of_a_resumed_run_keep_the_last_record(sweep: dict[str, Path]) -> None:
    row = compare.row_for(sweep["finished"])
    assert row.loss_curve == ((10, 10.0), (20, 8.0), (30, 9.0), (40, 5.0))
    assert row.val_curve == ((20, 6.0), (40, 4.5))
    stopped = compare.row_for(sweep["stopped"])
    assert (stopped.best, stopped.best_metric, stopped.best_step) == (2.0, "loss", 30)  # not the overwritten 0.5


def test_json_rows(sweep: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, str(sweep["finished"]), str(sweep["stopped"]), "--json")
    assert code == 0
    rows = json.loads(out)
    assert [r["point"] for r in rows] == [{"lr": "3e-4", "seed": "1"}, {"lr": "1e-3", "seed": "1"}]
    last = rows[1]
    assert last == {"run_dir": str(sweep["finished"]), "job_id": None, "point": {"lr": "1e-3", "seed": "1"},
                    "state": "COMPLETED", "state_source": "run folder (final.json)", "steps": 40, "restarts": 1,
                    "last_loss": 5.0, "best": 4.5, "best_metric": "val_loss", "best_step": 40, "ettr": None}


def test_one_metric_names_the_best_column_and_nan_is_not_json(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    run = make_run(tmp_path / "r", None, metrics=[{"step": 1, "loss": 3.0}, {"step": 2, "loss": float("nan")}])
    code, out, _ = run_cli(capsys, str(run))
    header, row = table_of(out)
    assert code == 0 and header[-2] == "best loss" and row[-3:] == ["nan", "3.0000", "-"] and header[0] == "run"
    code, out, _ = run_cli(capsys, str(run), "--json")
    assert json.loads(out)[0]["last_loss"] is None and "NaN" not in out


def test_a_job_id_or_its_folder_gets_the_job_records_state(sweep: dict[str, Path],
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    JobStore().add(JobRecord("77_0", "lm", "local", "local", 1, 2, str(sweep["finished"]), {}, {}, time.time()))
    for arg in ("77_0", str(sweep["finished"])):
        code, out, _ = run_cli(capsys, arg, "--json")
        (row,) = json.loads(out)
        assert code == 0 and row["job_id"] == "77_0" and row["state"] == "COMPLETED", row
        assert row["state_source"] == "run folder" and row["point"] == {"lr": "1e-3", "seed": "1"}
    code, out, _ = run_cli(capsys, "77_0", str(sweep["finished"]), "--json")
    assert len(json.loads(out)) == 1  # the same folder twice is one row


def test_plot_writes_a_png_of_every_curve(sweep: dict[str, Path], tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    both, one = tmp_path / "both.png", tmp_path / "one.png"
    code, out, err = run_cli(capsys, str(sweep["finished"]), str(sweep["stopped"]), "--plot", str(both))
    assert code == 0 and f"Wrote {both}" in err and "lr" in out
    assert run_cli(capsys, str(sweep["finished"]), "--plot", str(one))[0] == 0
    for png in (both, one):
        data = png.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000
    assert both.read_bytes() != one.read_bytes()
    assert sorted(p.name for p in tmp_path.glob("*.png*")) == ["both.png", "one.png"]
    assert not list(tmp_path.glob(".*.tmp"))  # written aside and renamed: no temp file left


@pytest.mark.parametrize(("suffix", "magic"), [(".pdf", b"%PDF"), (".svg", b"<?xml")])
def test_plot_format_follows_the_suffix(sweep: dict[str, Path], tmp_path: Path, suffix: str, magic: bytes,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / f"loss{suffix}"
    assert run_cli(capsys, str(sweep["finished"]), "--plot", str(out))[0] == 0
    assert out.read_bytes().startswith(magic)


def test_an_existing_plot_is_kept_unless_forced(sweep: dict[str, Path], tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "loss.png"
    out.write_bytes(b"precious")
    err = one_line_error(*run_cli(capsys, str(sweep["finished"]), "--plot", str(out)))
    assert "loss.png already exists; nothing was written" in err and "--force" in err
    assert out.read_bytes() == b"precious"
    assert run_cli(capsys, str(sweep["finished"]), "--plot", str(out), "--force")[0] == 0
    assert out.read_bytes().startswith(PNG_MAGIC)


def test_log_scale_when_the_losses_span_more_than_ten_times(tmp_path: Path) -> None:
    wide = compare.row_for(make_run(tmp_path / "w", None, metrics=[{"step": 1, "loss": 50.0},
                                                                   {"step": 2, "loss": 0.5}]))
    narrow = compare.row_for(make_run(tmp_path / "n", None, metrics=[{"step": 1, "loss": 5.0},
                                                                     {"step": 2, "loss": 1.0}]))
    assert plot.log_scale([wide]) and not plot.log_scale([narrow])


def one_line_error(code: int, out: str, err: str) -> str:
    assert code == 2 and out == "" and err.count("\n") == 1 and "HINT:" in err, (code, out, err)
    return err


def test_without_matplotlib_plot_fails_in_one_line(sweep: dict[str, Path], tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    err = one_line_error(*run_cli(capsys, str(sweep["finished"]), "--plot", str(tmp_path / "loss.png")))
    assert "needs matplotlib" in err and "pip install matplotlib into" in err and "pip install '.[plot]'" in err
    assert not (tmp_path / "loss.png").exists()
    assert run_cli(capsys, str(sweep["finished"]))[0] == 0  # the table needs no matplotlib


def test_bad_arguments_fail_in_one_line(sweep: dict[str, Path], tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "sweep" / "9"
    err = one_line_error(*run_cli(capsys, str(sweep["finished"]), str(missing)))
    assert f"run folder {missing} does not exist" in err and "spec.json" in err and "metrics.jsonl" in err
    err = one_line_error(*run_cli(capsys, str(tmp_path / "sweep")))
    assert "is not a run folder: it holds neither spec.json nor metrics.jsonl" in err
    err = one_line_error(*run_cli(capsys, "4242"))
    assert "'4242' is neither a folder here nor a job hpcjobs knows" in err
    err = one_line_error(*run_cli(capsys, str(sweep["finished"]), "--plot", str(tmp_path / "loss.jpg")))
    assert "valid: .png, .pdf, .svg" in err
    err = one_line_error(*run_cli(capsys, str(sweep["finished"]), "--plot", str(tmp_path / "no" / "loss.png")))
    assert "does not exist" in err


@pytest.mark.train
def test_answers_do_not_depend_on_the_slurm_tools_on_path(tmp_path: Path) -> None:
    """On a machine whose squeue cannot reach a controller, the test above still passes: no test asks this
    machine's Slurm (conftest's `no_slurm_on_path`)."""
    broken = tmp_path / "broken-slurm"
    broken.mkdir()
    for name in ("squeue", "sacct", "scontrol"):
        (broken / name).write_text("#!/bin/sh\necho 'slurm_load_jobs error: Unable to contact slurm controller' >&2\n"
                                   "exit 1\n")
        (broken / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{broken}:{os.environ['PATH']}"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                          f"{__file__}::test_bad_arguments_fail_in_one_line"], capture_output=True, text=True,
                         cwd=REPO, env=env, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:]


NO_TORCH = """
import sys
from hpcjobs.cli import main
assert main(["compare", {run!r}, "--plot", {png!r}]) == 0
assert "torch" not in sys.modules, "torch was imported"
"""


def test_compare_never_imports_torch_and_has_examples(sweep: dict[str, Path], tmp_path: Path) -> None:
    code = NO_TORCH.format(run=str(sweep["finished"]), png=str(tmp_path / "x.png"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    help_ = subprocess.run([str(BIN / "hpcjobs"), "compare", "--help"], capture_output=True, text=True, timeout=60)
    assert "examples:" in help_.stdout and "hpcjobs compare RUN_OR_ID... [--plot loss.png] [--json]" in help_.stdout


@pytest.mark.train
def test_two_local_runs_compared_by_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """End to end: two tiny jobs of the local profile (side by side), then their table and plot."""
    runs = [tmp_path / "runs" / "lr-0.05", tmp_path / "runs" / "lr-0.01"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    JobStore().check()  # created first: two submits creating a fresh store at once can meet "database is locked"
    work = tmp_path / "work"  # an empty project folder: the other job's run folder must not be in its code snapshot
    work.mkdir()
    procs = [subprocess.Popen([str(BIN / "hpcjobs"), "submit", "--profile", "local", "--gpus", "1", "--run-dir",
                               str(run), "trainers.tasks.classifier", "--steps", "6", "--log-every", "2",
                               "--eval-every", "3", "--lr", run.name[3:]], cwd=work, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for run in runs]
    for proc in procs:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out[-2000:]
    png = tmp_path / "loss.png"
    code, out, _ = run_cli(capsys, *(str(r) for r in runs), "--plot", str(png), "--json")
    rows = json.loads(out)
    assert code == 0 and [r["run_dir"] for r in rows] == sorted(str(r) for r in runs)  # no points: by folder
    for row in rows:
        assert row["state"] == "COMPLETED" and row["steps"] == 6 and row["restarts"] == 0, row
        assert row["job_id"].startswith("local-") and row["best_metric"] == "val_loss" and row["best_step"] in (3, 6)
        assert row["last_loss"] is not None
    assert png.read_bytes().startswith(PNG_MAGIC)
