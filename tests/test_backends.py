"""The scheduler backends behind their seam: state answers from command output recorded on the test cluster, the one
flag table feeding both Slurm paths, environment cleaning, run-folder patterns, and the one-place-per-fact rules."""

from __future__ import annotations

import ast
import inspect
import json
import os
import re
import subprocess
import time
from collections.abc import Sequence
from dataclasses import field, fields, make_dataclass, replace
from pathlib import Path

import pytest
import submitit
import yaml
from submitit.slurm import slurm as submitit_slurm

from conftest import REPO, hpcjobs, sbatch_shim
from hpcjobs.backends import SCHEDULERS, backend_for
from hpcjobs.backends.local.local import LocalBackend
from hpcjobs.backends.local.queue import rank_envs
from hpcjobs.backends.slurm.sbatch import (
    SUBMITIT_NATIVE,
    job_comment,
    render_sbatch,
    run_dir_of_comment,
    submitit_parameters,
)
from hpcjobs.backends.slurm.slurm import SlurmBackend
from hpcjobs.backends.start_env import clean, cleaned_os_environ
from hpcjobs.follow.status import cancel, last_step, status_of
from hpcjobs.jobs.store import JobRecord, JobStore
from hpcjobs.profiles.cluster_profile import load_profile
from hpcjobs.protocol.contract import LaunchContract, Preemption
from hpcjobs.protocol.errors import RuntimeFailure, UsageError
from hpcjobs.protocol.runfolder import RunDirPatternError, RunFolder, resolve_run_dir
from hpcjobs.protocol.states import FinalState, JobState
from hpcjobs.request.spec import Request, build_spec

# Recorded on the test cluster (Slurm 22.05, tests/cluster/testcluster.sh): (exit code, stdout, stderr).
# `{comment}`: the job's comment, hpcjobs:run=<its run folder> (hpcjobs.backends.slurm.sbatch.job_comment).
SQUEUE = {
    "running": (0, "RUNNING|{comment}\n", ""),
    "pending": (0, "PENDING|{comment}\n", ""),
    "completed": (0, "COMPLETED|{comment}\n", ""),
    "cancelled": (0, "CANCELLED|{comment}\n", ""),
    "another-job": (0, "RUNNING|hpcjobs:run=/elsewhere/run\n", ""),  # the id again, on a rebuilt cluster
    "not-hpcjobs": (0, "RUNNING|\n", ""),
    "forgotten": (1, "", "slurm_load_jobs error: Invalid job id specified\n"),  # past MinJobAge, or never existed
    "unreachable": (1, "", "slurm_load_jobs error: Unable to contact slurm controller (connect failure)\n"),
}
SACCT = {  # without AccountingStoreFlags=job_comment, sacct keeps no comment
    "cancelled": (0, "CANCELLED by 0|\n", ""),
    "completed": (0, "COMPLETED|\n", ""),
    "failed": (0, "FAILED|\n", ""),
    "unknown-id": (0, "", ""),
    "no-accounting": (1, "", "Slurm accounting storage is disabled\n"),
}


class Recorded:
    """A runner answering each command with recorded output, and remembering what was asked."""

    def __init__(self, **answers: tuple[int, str, str]) -> None:
        self.answers = answers
        self.calls: list[list[str]] = []

    def __call__(self, argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        self.calls.append(list(argv))
        rc, out, err = self.answers.get(argv[0], (127, "", f"{argv[0]}: command not found"))
        return subprocess.CompletedProcess(list(argv), rc, out, err)


def record(tmp_path: Path, scheduler: str = "slurm", cancelled: float | None = None) -> JobRecord:
    return JobRecord(job_id="42", name="lm", profile="p", scheduler=scheduler, nodes=2, gpus_per_node=8,
                     run_dir=str(tmp_path / "run"), logs={}, spec={}, submitted=time.time(), cancelled=cancelled)


UNREACHABLE = "squeue could not answer for job 42: slurm_load_jobs error: Unable to contact slurm controller " \
              "(connect failure)"


@pytest.mark.parametrize("squeue,sacct,final,cancelled,expected", [
    ("running", "no-accounting", None, None, (JobState.RUNNING, "squeue")),
    ("pending", "no-accounting", None, None, (JobState.PENDING, "squeue")),
    ("cancelled", "cancelled", None, None, (JobState.CANCELLED, "squeue")),
    ("forgotten", "cancelled", None, None, (JobState.CANCELLED, "sacct")),
    ("forgotten", "failed", FinalState.FINISHED, None, (JobState.FAILED, "sacct; the run folder says COMPLETED")),
    ("forgotten", "no-accounting", FinalState.FINISHED, None, (JobState.COMPLETED, "run folder")),
    ("forgotten", "no-accounting", FinalState.FAILED, None, (JobState.FAILED, "run folder")),
    ("forgotten", "unknown-id", None, 1.0, (JobState.CANCELLED, "store")),
    ("forgotten", "no-accounting", None, None, (JobState.UNKNOWN, "none")),
    ("completed", "no-accounting", FinalState.FAILED, None, (JobState.COMPLETED, "squeue; the run folder says FAILED")),
    ("unreachable", "failed", None, None, (JobState.FAILED, f"sacct ({UNREACHABLE})")),  # slurmdbd still answers
    ("unreachable", "no-accounting", FinalState.FINISHED, None, (JobState.COMPLETED, f"run folder ({UNREACHABLE})")),
    ("unreachable", "no-accounting", None, None, (JobState.UNKNOWN, UNREACHABLE)),
])
def test_slurm_state_from_recorded_output(squeue: str, sacct: str, final: FinalState | None, cancelled: float | None,
                                          expected: tuple[JobState, str], tmp_path: Path) -> None:
    rec = record(tmp_path, cancelled=cancelled)
    if final is not None:
        RunFolder(rec.run_dir).write_final(final, "test", 10)
    runner = Recorded(squeue=answer(SQUEUE[squeue], rec), sacct=SACCT[sacct])
    st = status_of(rec, SlurmBackend(runner))
    assert (st.state, st.state_source) == expected
    assert runner.calls[0] == ["squeue", "-h", "-t", "all", "-j", "42", "-o", "%T|%k"]


def test_a_forgotten_job_stopped_by_sigterm_that_never_came_back_was_cancelled(tmp_path: Path) -> None:
    rec = record(tmp_path)
    run = RunFolder(rec.run_dir)
    run.record_start(0, "42", 4)
    run.record_stop("terminated", 14, 0)
    forgotten = SlurmBackend(Recorded(squeue=SQUEUE["forgotten"], sacct=SACCT["no-accounting"]))
    st = status_of(rec, forgotten)
    assert st.state == JobState.CANCELLED and st.state_source.startswith("run folder: stopped by SIGTERM"), st
    run.record_start(1, "42", 4)  # an outside `scontrol requeue` brought it back: not cancelled
    assert status_of(rec, forgotten).state == JobState.UNKNOWN
    run.record_stop("preemption", 20, 1)
    assert status_of(rec, forgotten).state == JobState.UNKNOWN


def test_a_forgotten_job_that_never_started_says_so(tmp_path: Path) -> None:
    rec = record(tmp_path)
    st = status_of(rec, SlurmBackend(Recorded(squeue=SQUEUE["forgotten"], sacct=SACCT["no-accounting"])))
    assert st.state == JobState.UNKNOWN and st.final_reason == ("no rank of this job ever started (cancelled while "
                                                                "pending, or it never ran)")
    RunFolder(rec.run_dir).record_start(0, "42", 4)
    st = status_of(rec, SlurmBackend(Recorded(squeue=SQUEUE["forgotten"], sacct=SACCT["no-accounting"])))
    assert st.state == JobState.UNKNOWN and st.final_reason is None


def answer(recorded: tuple[int, str, str], rec: JobRecord) -> tuple[int, str, str]:
    rc, out, err = recorded
    return rc, out.replace("{comment}", job_comment(rec.run_dir)), err


@pytest.mark.parametrize("squeue", ["another-job", "not-hpcjobs"])
def test_a_job_of_the_same_id_that_is_not_the_records_is_never_joined_with_it(squeue: str, tmp_path: Path) -> None:
    rec = record(tmp_path)
    runner = Recorded(squeue=SQUEUE[squeue], sacct=SACCT["no-accounting"])
    st = status_of(rec, SlurmBackend(runner))
    assert st.state == JobState.UNKNOWN and "squeue's job 42 is another job" in st.state_source, st
    RunFolder(rec.run_dir).write_final(FinalState.FINISHED, "test", 10, job_id="42")
    st = status_of(rec, SlurmBackend(runner))  # the run folder's own word, saying why Slurm's was not taken
    assert st.state == JobState.COMPLETED and st.state_source.startswith("run folder (squeue's job 42 is another")
    RunFolder(rec.run_dir).final.unlink()
    (RunFolder(rec.run_dir).path / "finals" / "42.json").unlink()  # no final word of this job at all
    store = JobStore(tmp_path / "jobs.sqlite")
    with pytest.raises(RuntimeFailure, match="job 42 was not cancelled: squeue's job 42 is another job"):
        cancel(rec, store, SlurmBackend(runner))
    assert not any(c[0] == "scancel" for c in runner.calls)


def test_a_job_not_in_the_store_is_found_by_its_comment(tmp_path: Path) -> None:
    run_dir = tmp_path / "it's a run; %j"
    comment = job_comment(str(run_dir))
    assert "'" not in comment and " " not in comment and run_dir_of_comment(comment) == str(run_dir)
    fields = (f"JobId=42 JobName=lm NumNodes=2 NumTasks=4 SubmitTime=2026-11-23T10:00:00 "
              f"StdOut=/logs/lm-42.out Comment={comment}\n")
    runner = Recorded(squeue=(0, f"RUNNING|{comment}\n", ""), scontrol=(0, fields, ""))
    rec = SlurmBackend(runner).lookup("42")
    assert rec is not None and rec.run_dir == str(tmp_path / "it's a run; 42")
    assert (rec.name, rec.nodes, rec.gpus_per_node, rec.logs) == ("lm", 2, 2, {"slurm": "/logs/lm-42.out"})
    assert SlurmBackend(Recorded(squeue=SQUEUE["not-hpcjobs"])).lookup("42") is None


def test_a_job_slurm_could_not_be_asked_about_is_not_called_unknown(tmp_path: Path) -> None:
    """With the controller down, `status ID` of a job the store does not hold said the scheduler knows no such
    job (exit 2, a bad input): it is Slurm that could not say. sacct, which asks the accounting daemon, may still."""
    for sacct in ("no-accounting", "unknown-id"):
        with pytest.raises(RuntimeFailure, match=f"^{re.escape(UNREACHABLE)}$") as e:
            SlurmBackend(Recorded(squeue=SQUEUE["unreachable"], sacct=SACCT[sacct])).lookup("42")
        assert e.value.exit_code == 1 and "scontrol ping" in e.value.one_line()
    comment = job_comment(str(tmp_path / "run"))
    found = SlurmBackend(Recorded(squeue=SQUEUE["unreachable"], sacct=(0, f"RUNNING|{comment}\n", ""))).lookup("42")
    assert found is not None and found.run_dir == str(tmp_path / "run")
    assert SlurmBackend(Recorded(squeue=SQUEUE["forgotten"], sacct=SACCT["no-accounting"])).lookup("42") is None
    assert SlurmBackend(Recorded()).lookup("42") is None  # no Slurm here at all: nothing to ask, nothing known
    unconfigured = (1, "", "squeue: error: resolve_ctls_from_dns_srv: res_nsearch error: Unknown host\n"
                           "squeue: error: fetch_config: DNS SRV lookup failed\n"
                           "squeue: error: _establish_config_source: failed to fetch config\n"
                           "squeue: fatal: Could not establish a configuration source\n")
    assert SlurmBackend(Recorded(squeue=unconfigured, sacct=unconfigured)).lookup("42") is None  # client tools only
    down = Recorded(squeue=SQUEUE["unreachable"])
    assert SlurmBackend(down).lookup("local-20261125-1") is None and down.calls == []  # not an id Slurm gives


def test_slurm_cancel_refused_is_a_runtime_failure_and_records_nothing(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "jobs.sqlite")
    rec = record(tmp_path)
    store.add(rec)
    refuse = Recorded(squeue=answer(SQUEUE["running"], rec),
                      scancel=(1, "", "scancel: error: Access/permission denied\n"))
    with pytest.raises(RuntimeFailure, match="permission denied"):
        cancel(rec, store, SlurmBackend(refuse))
    assert store.get("42").cancelled is None
    ok = Recorded(squeue=answer(SQUEUE["running"], rec), scancel=(0, "", ""))
    assert cancel(rec, store, SlurmBackend(ok)) == "job 42 cancelled (was RUNNING)"
    assert store.get("42").cancelled is not None
    done = Recorded(squeue=answer(SQUEUE["completed"], rec))
    assert "already ended (COMPLETED)" in cancel(rec, store, SlurmBackend(done))


def fake_launcher(run: RunFolder, job_id: str) -> subprocess.Popen[bytes]:
    """A process that looks like a local job's launcher (its command line says hpcjobs), recorded as the job's."""
    proc = subprocess.Popen(["bash", "-c", "exec -a hpcjobs sleep 60"])
    cmdline = Path(f"/proc/{proc.pid}/cmdline")
    deadline = time.time() + 10
    while not cmdline.read_bytes().startswith(b"hpcjobs") and time.time() < deadline:
        time.sleep(0.01)  # until bash has exec'd under its new name
    run.path.mkdir(parents=True, exist_ok=True)
    (run.local_process).write_text(json.dumps({"pid": proc.pid, "host": os.uname().nodename, "job_id": job_id}))
    return proc


def test_local_state_knows_whether_the_job_lives(tmp_path: Path) -> None:
    rec = record(tmp_path, scheduler="local")
    run = RunFolder(rec.run_dir)
    assert status_of(rec, LocalBackend()).state is JobState.UNKNOWN
    proc = fake_launcher(run, rec.job_id)
    run.write_heartbeat(5)
    assert status_of(rec, LocalBackend()).state is JobState.RUNNING
    proc.kill()
    proc.wait()
    st = status_of(rec, LocalBackend())  # SIGKILLed: it used to show RUNNING forever
    assert st.state is JobState.FAILED and "processes are gone" in st.state_source
    run.record_stop("interrupt", 7, 0)
    st = status_of(rec, LocalBackend())
    assert (st.state, st.last_step) == (JobState.STOPPED, 7)  # the committed step, not the last logged one
    run.write_final(FinalState.FINISHED, "done", 9)
    st = status_of(rec, LocalBackend())
    assert (st.state, st.state_source, st.last_step) == (JobState.COMPLETED, "run folder", 9)


def test_local_cancel_stops_the_running_job(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "jobs.sqlite")
    rec = record(tmp_path, scheduler="local")
    store.add(rec)
    proc = fake_launcher(RunFolder(rec.run_dir), rec.job_id)
    said = cancel(rec, store, LocalBackend())
    assert "asked to stop" in said and proc.wait(timeout=10) == -15  # SIGTERM: the launcher checkpoints and stops
    assert "not running here" in LocalBackend().cancel(rec)


# --- one flag table for both Slurm paths ---------------------------------------------------------------------------

def shipped_slurm_profiles() -> list[str]:
    return sorted(p.stem for p in (REPO / "cluster_profiles").glob("*.yaml")
                  if load_profile(str(p)).scheduler == "slurm")


def spec_for(profile: str, tmp_path: Path, **req: object):
    prof = replace(load_profile(str(REPO / "cluster_profiles" / f"{profile}.yaml")), runs_dir=str(tmp_path))
    return build_spec(prof, Request(entry="trainers.tasks.lm", nodes=2, gpus=8, time="4:00:00", **req),
                      backend_for(prof.scheduler), workdir=REPO)  # type: ignore[arg-type]


def directives(text: str) -> list[str]:
    return sorted(line.split(None, 1)[1] for line in text.splitlines() if line.startswith("#SBATCH "))


@pytest.mark.parametrize("profile", shipped_slurm_profiles())
def test_submitit_writes_exactly_the_sbatch_scripts_flags(profile: str, tmp_path: Path) -> None:
    """Through submitit's own executor (its parameter check and its sbatch writer): the same #SBATCH lines as the
    rendered script, once each, but for the log file (each path logs in its own place)."""
    spec = spec_for(profile, tmp_path)
    executor = submitit.SlurmExecutor(folder=tmp_path / "submitit")
    executor.update_parameters(**submitit_parameters(spec))
    theirs = directives(executor._make_submission_file_text("true", "uid"))
    ours = directives(render_sbatch(spec))
    assert len(set(theirs)) == len(theirs), f"a flag written twice: {theirs}"
    drop = re.compile(r"^--(output|error)=")
    assert [d for d in theirs if not drop.match(d)] == [d for d in ours if not drop.match(d)]


def test_submitit_native_keywords_exist_in_submitit() -> None:
    params = set(inspect.signature(submitit_slurm._make_sbatch_string).parameters)
    assert SUBMITIT_NATIVE <= params


def test_a_new_profile_flag_reaches_both_paths_from_one_place(tmp_path: Path) -> None:
    """A new pass-through sbatch flag is one field of ClusterProfile naming it (here made on the fly as a subclass
    with `reservation`): the rendered script and submitit's both carry it, and nothing else was touched."""
    base = spec_for("testcluster", tmp_path)
    extended = make_dataclass("Extended", [("reservation", "str | None", field(
        default="maint", metadata={"sbatch": "reservation"}))], bases=(type(base.profile),), frozen=True)
    profile = extended(**{f.name: getattr(base.profile, f.name) for f in fields(base.profile)})
    spec = replace(base, profile=profile)
    executor = submitit.SlurmExecutor(folder=tmp_path / "submitit")
    executor.update_parameters(**submitit_parameters(spec))
    for text in (render_sbatch(spec), executor._make_submission_file_text("true", "uid")):
        assert "#SBATCH --reservation=maint" in text
    assert "--reservation" not in render_sbatch(base)


# --- environment ---------------------------------------------------------------------------------------------------

OUTER_JOB = {"SLURM_JOB_ID": "999", "SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_RESTART_COUNT": "2",
             "SLURM_ARRAY_TASK_ID": "1", "SRUN_DEBUG": "3", "SBATCH_PARTITION": "bogus", "SLURMD_NODENAME": "n9",
             "SALLOC_PARTITION": "x", "RANK": "3", "WORLD_SIZE": "4", "MASTER_PORT": "1", "TORCHELASTIC_RUN_ID": "r",
             "HPCJOBS_CONTRACT": "{}", "SLURM_CONF": "/etc/slurm/slurm.conf", "PATH": "/usr/bin", "WANDB_MODE": "x"}


def test_job_variables_are_cleaned_by_prefix() -> None:
    assert clean(OUTER_JOB) == {"SLURM_CONF": "/etc/slurm/slurm.conf", "PATH": "/usr/bin", "WANDB_MODE": "x"}


def test_local_ranks_never_inherit_an_outer_jobs_identity(tmp_path: Path) -> None:
    prof = replace(load_profile("local"), runs_dir=str(tmp_path))
    spec = build_spec(prof, Request(entry="trainers.tasks.lm", gpus=2), backend_for(prof.scheduler), workdir=REPO)
    envs = rank_envs(spec, "local-1", 12345, dict(OUTER_JOB))
    assert [e["RANK"] for e in envs] == ["0", "1"] and {e["WORLD_SIZE"] for e in envs} == {"2"}
    for env in envs:
        assert not [k for k in env if k.startswith(("SLURM_JOB", "SLURM_PROCID", "SRUN_", "SBATCH_", "SLURMD_"))]
        assert env["MASTER_PORT"] == "12345" and "HPCJOBS_CONTRACT" not in env


def test_os_environ_is_cleaned_for_a_submission_then_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in OUTER_JOB.items():
        monkeypatch.setenv(k, v)
    with cleaned_os_environ():
        assert "SLURM_JOB_ID" not in os.environ and "SBATCH_PARTITION" not in os.environ
        assert os.environ["SLURM_CONF"] == "/etc/slurm/slurm.conf"
    assert all(os.environ[k] == v for k, v in OUTER_JOB.items())


@pytest.fixture
def fake_sbatch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """sbatch that keeps the environment it was called with and answers like Slurm."""
    sbatch_shim(tmp_path, monkeypatch, f'env > "{tmp_path}/sbatch.env"\necho "Submitted batch job 4711"\n')
    return tmp_path / "sbatch.env"


def test_submitting_from_inside_an_allocation_passes_none_of_it_on(fake_sbatch: Path, tmp_path: Path) -> None:
    prof = tmp_path / "p.yaml"
    data = yaml.safe_load((REPO / "cluster_profiles" / "testcluster.yaml").read_text())
    prof.write_text(yaml.safe_dump({**data, "runs_dir": f"{tmp_path}/r"}))
    outer = {k: v for k, v in OUTER_JOB.items() if k != "PATH"}  # the shim must stay first on PATH
    out = hpcjobs("submit", "--profile", str(prof), "trainers.tasks.lm", "--steps", "5", cwd=REPO, env=outer)
    assert out.returncode == 0, out.stderr
    seen = dict(line.split("=", 1) for line in fake_sbatch.read_text().splitlines() if "=" in line)
    assert not [k for k in OUTER_JOB if k in seen and k not in ("SLURM_CONF", "PATH", "WANDB_MODE")], seen


# --- run-folder patterns ---------------------------------------------------------------------------------------------

def test_run_dir_patterns_resolve_from_the_jobs_ids() -> None:
    env = {"SLURM_JOB_ID": "57", "SLURM_ARRAY_JOB_ID": "50", "SLURM_ARRAY_TASK_ID": "7"}
    assert resolve_run_dir("/r/x-%j", env) == "/r/x-57"
    assert resolve_run_dir("/r/s-%A/%a", env) == "/r/s-50/7"
    assert resolve_run_dir("/r/x-%j", {"HPCJOBS_JOB_ID": "local-1"}) == "/r/x-local-1"
    assert resolve_run_dir("/r/plain", {}) == "/r/plain"
    with pytest.raises(RunDirPatternError, match="%a"):
        resolve_run_dir("/r/%a", {"SLURM_JOB_ID": "57"})


def test_submit_with_a_pattern_records_the_real_folder(fake_sbatch: Path, tmp_path: Path) -> None:
    """`--run-dir 'runs/x-%j'` used to create a folder literally named x-%j and record it."""
    prof = tmp_path / "p.yaml"
    prof.write_text((REPO / "cluster_profiles" / "testcluster.yaml").read_text())
    out = hpcjobs("submit", "--profile", str(prof), "--run-dir", "runs/x-%j", "--json", "trainers.tasks.lm",
                  cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    sub = json.loads(out.stdout)
    assert sub["job_id"] == "4711" and sub["run_dir"] == str(tmp_path / "runs" / "x-4711")
    assert (tmp_path / "runs" / "x-4711" / "spec.json").is_file()
    assert not list(tmp_path.rglob("*%j*")), "a folder with a literal %j was made"
    listed = json.loads(hpcjobs("list", "--json").stdout)
    assert [j["run_dir"] for j in listed] == [sub["run_dir"]]


@pytest.mark.train
def test_local_run_with_a_pattern_runs_in_the_real_folder(tmp_path: Path) -> None:
    out = hpcjobs("submit", "--profile", "local", "--gpus", "1", "--run-dir", "runs/x-%j", "--json",
                  "trainers.tasks.classifier", "--steps", "2", "--log-every", "1", cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr
    sub = json.loads(out.stdout.split("\n{", 1)[-1] if not out.stdout.startswith("{") else out.stdout)
    run = Path(sub["run_dir"])
    assert run.name.startswith("x-local-") and (run / "final.json").is_file()
    assert not list(tmp_path.rglob("*%j*"))


# --- one place per fact --------------------------------------------------------------------------------------------

SOURCES = sorted([*(REPO / "hpcjobs").rglob("*.py"), *(REPO / "trainers").rglob("*.py")])


def test_no_scheduler_branch_outside_the_backends() -> None:
    offenders = [f"{p.relative_to(REPO)}:{i}" for p in SOURCES if not {"backends", "jobenv"} & set(p.parts)
                 for i, line in enumerate(p.read_text().splitlines(), 1)
                 if re.search(r"scheduler\s*[!=]=|[!=]=\s*[\w.]*scheduler\b", line)]
    assert offenders == []
    assert set(SCHEDULERS) == {p.stem for p in (REPO / "hpcjobs" / "backends").glob("*/*.py")
                               if p.stem == p.parent.name and "BACKEND = " in p.read_text()}
    assert [backend_for(s).name for s in SCHEDULERS] == list(SCHEDULERS)


def test_slurm_commands_are_called_only_behind_the_seam() -> None:
    calls = re.compile(r"[\"'](squeue|sacct|scancel|scontrol|sbatch)[\"']\s*,")
    offenders = [f"{p.relative_to(REPO)}:{i}" for p in SOURCES if not {"backends", "jobenv"} & set(p.parts)
                 for i, line in enumerate(p.read_text().splitlines(), 1) if calls.search(line)]
    assert offenders == []


def restated_defaults(tree: ast.AST, defaults: Preemption) -> list[str]:
    """Places in code (not prose) that write a preemption default again: the signal's name as a value anywhere, or
    the warning seconds / restart cap as the default of something named after them (an argument, a field, a
    `.get(NAME, default)`)."""
    names = re.compile(r"signal|seconds|restart", re.I)
    numbers = {defaults.seconds_before, str(defaults.seconds_before), defaults.max_restarts, str(defaults.max_restarts)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and node.value in (defaults.signal, f"SIG{defaults.signal}"):
            found.append(f"line {node.lineno}: {node.value!r}")
        pairs: list[tuple[str, ast.expr | None]] = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args.args + node.args.kwonlyargs
            given = [None] * (len(node.args.args) - len(node.args.defaults)) + node.args.defaults + \
                node.args.kw_defaults
            pairs += [(a.arg, d) for a, d in zip(args, given, strict=True)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            pairs.append((node.target.id, node.value))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and len(node.args) == 2 and isinstance(node.args[0], ast.Constant):
            pairs.append((str(node.args[0].value), node.args[1]))
        found += [f"line {d.lineno}: {n} = {d.value!r}" for n, d in pairs
                  if d is not None and isinstance(d, ast.Constant) and d.value in numbers and names.search(n)]
    return found


def test_the_preemption_defaults_are_written_once() -> None:
    home = REPO / "hpcjobs" / "protocol" / "contract.py"
    assert restated_defaults(ast.parse(home.read_text()), Preemption())  # the check finds them at home
    for path in SOURCES:
        if path != home:
            assert restated_defaults(ast.parse(path.read_text()), Preemption()) == [], path.relative_to(REPO)


def test_contract_round_trips_and_refuses_garbage() -> None:
    c = LaunchContract("/r/x-%j", Preemption("USR1", 120, 3), time_limit_s=3600)
    assert LaunchContract.from_json(c.to_json()) == c
    started = c.started({"SLURM_JOB_ID": "9"}, 100.0)
    assert started.run_dir == "/r/x-9" and started.start_time == 100.0
    assert started.signal_due(None) == 100 + 3600 - 120  # no end stated by the scheduler: start + limit
    assert started.signal_due(5000) == 5000 - 120
    from hpcjobs.protocol.contract import ContractError
    for bad in ("", "{", '{"run_dir": ""}', '{"run_dir": "/r", "surprise": 1}', '{"preemption": {"x": 1}}'):
        with pytest.raises(ContractError):
            LaunchContract.from_json(bad)


def test_local_backend_refuses_what_it_cannot_do(tmp_path: Path) -> None:
    prof = replace(load_profile("local"), runs_dir=str(tmp_path))
    local = backend_for("local")
    with pytest.raises(UsageError, match="valid: 1"):
        local.check(build_spec(prof, Request(entry="trainers.tasks.lm", nodes=2), local, workdir=REPO))
    spec = build_spec(prof, Request(entry="trainers.tasks.lm", gpus=2), local, workdir=REPO)
    local.check(spec)
    with pytest.raises(UsageError, match="no sbatch script"):
        backend_for("local").script(spec)
    assert "RANK=1 LOCAL_RANK=1 WORLD_SIZE=2" in backend_for("local").dry_run(spec).text


def test_the_last_step_does_not_go_back_when_the_next_start_begins(tmp_path: Path) -> None:
    """Issue 26: a stop at step 63 (last heartbeat 60) read "last step 63", then 60 once the job started again."""
    run = RunFolder(tmp_path / "run")
    run.record_start(0, "42", 2)
    run.write_heartbeat(60)
    run.record_stop("preemption", 63, 0)
    assert last_step(run)[0] == 63
    run.record_start(1, "42", 2)
    assert last_step(run)[0] == 63
    time.sleep(0.01)
    run.write_heartbeat(65)
    assert last_step(run)[0] == 65
