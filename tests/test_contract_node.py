"""The node side of the launch contract: the launcher reads it once, the preemption protocol and StopGuard take it
explicitly, Slurm is asked through trainers.jobenv.slurm (fed recorded `scontrol show job -o` lines here),
and the trainer's flags are parsed exactly and checked with one-line errors (also used at submit time)."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hpcjobs.protocol.contract import ENV_VAR, LaunchContract, Preemption
from hpcjobs.protocol.faultpolicy import restartcap
from hpcjobs.protocol.runfolder import RunFolder
from hpcjobs.protocol.settings.taskargs import TaskArgError
from hpcjobs.protocol.settings.trainconfig import TrainConfig
from hpcjobs.protocol.settings.trainflags import ConfigError, parse_trainer_args, reference_table
from hpcjobs.protocol.states import FinalState, StopOutcome, StopReason
from trainers import preemption
from trainers.jobenv import slurm as slurm_control

REPO = Path(__file__).resolve().parent.parent
REMOVED_VARIABLES = ("HPCJOBS_SIGNAL", "HPCJOBS_SIGNAL_SECONDS", "HPCJOBS_MAX_RESTARTS",
                     "HPCJOBS_START_TIME", "HPCJOBS_TIME_LIMIT")
DEFAULTS = Preemption()
"""The preemption defaults, from their one home."""

# `scontrol show job -o` lines as the test cluster (Slurm 22.05) printed them, shortened to the fields that matter.
SHOW_JOB = {
    "grace": "JobId=3 JobName=lm UserId=root(0) JobState=RUNNING Reason=None Requeue=1 Restarts=0 "
             "RunTime=00:00:21 TimeLimit=00:30:00 SubmitTime=2026-11-22T17:21:20 StartTime=2026-11-22T17:21:27 "
             "EndTime=2026-11-22T17:51:27 PreemptEligibleTime=2026-11-22T17:21:48 PreemptTime=2026-11-22T17:21:51 "
             "SuspendTime=None Partition=low NodeList=node[1-2]",
    "scancel": "JobId=1 JobName=lm JobState=COMPLETING Reason=None Restarts=1 EndTime=2026-11-22T16:02:10 "
               "PreemptTime=None SuspendTime=None Partition=low",
    "running": "JobId=4 JobName=lm JobState=RUNNING Reason=None Restarts=0 EndTime=2026-11-22T18:00:00 "
               "PreemptTime=None Partition=low",
    "timeout": "JobId=5 JobName=lm JobState=TIMEOUT Reason=TimeLimit EndTime=2026-11-22T16:10:00 PreemptTime=None",
    "pending": "JobId=6 JobName=lm JobState=PENDING Reason=BeginTime Restarts=2 EndTime=Unknown PreemptTime=None",
}


def answer(line: str, rc: int = 0, calls: list[list[str]] | None = None) -> Callable[..., Any]:
    def run(argv: list[str], **kw: Any) -> SimpleNamespace:
        if calls is not None:
            calls.append(argv)
        return SimpleNamespace(returncode=rc, stdout=line, stderr="")
    return run


@pytest.fixture
def clean_preemption() -> Iterator[None]:
    preemption.reset()
    yield
    preemption.reset()
    for num in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM):
        signal.signal(num, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


# --- trainers.jobenv.slurm ------------------------------------------------------------------------------

def test_show_job_lines_parse_into_fields() -> None:
    fields = slurm_control.job_fields("3", answer(SHOW_JOB["grace"]))
    assert fields["JobState"] == "RUNNING" and fields["PreemptTime"] == "2026-11-22T17:21:51"
    assert fields["NodeList"] == "node[1-2]" and fields["UserId"] == "root(0)"
    assert slurm_control.end_time(fields) == time.mktime((2026, 11, 22, 17, 51, 27, 0, 0, -1))  # local time
    assert slurm_control.end_time(slurm_control.parse_show_job(SHOW_JOB["pending"])) is None  # EndTime=Unknown
    assert slurm_control.end_time({}) is None


def test_no_slurm_job_id_or_no_scontrol_asks_nothing() -> None:
    calls: list[list[str]] = []
    assert slurm_control.job_fields("local-7", answer(SHOW_JOB["grace"], calls=calls)) == {} and not calls

    def missing(argv: list[str], **kw: Any) -> None:
        raise FileNotFoundError("scontrol")

    def slow(argv: list[str], **kw: Any) -> None:
        raise subprocess.TimeoutExpired(argv, kw.get("timeout", 0))

    assert slurm_control.job_fields("3", missing) == {} and slurm_control.job_fields("3", slow) == {}


def test_sigterm_counts_as_preemption_only_while_running_with_a_preempt_time() -> None:
    """Lines as `scontrol show job -o` printed them on the test cluster at each kind of SIGTERM."""
    assert slurm_control.preempted_with_sigterm("3", answer(SHOW_JOB["grace"]))
    assert not any(slurm_control.preempted_with_sigterm("3", answer(SHOW_JOB[k]))
                   for k in ("scancel", "running", "timeout", "pending"))
    assert not slurm_control.preempted_with_sigterm("", answer(SHOW_JOB["grace"]))

    def missing(argv: list[str], **kw: Any) -> None:
        raise FileNotFoundError("scontrol")

    assert not slurm_control.preempted_with_sigterm("3", missing)


def test_requeue_tolerates_a_job_slurm_already_requeues() -> None:
    calls: list[list[str]] = []
    state = {"line": SHOW_JOB["pending"]}

    def runner(argv: list[str], **kw: Any) -> SimpleNamespace:
        calls.append(argv)
        if argv[1] == "requeue":
            return SimpleNamespace(returncode=1, stdout="", stderr="Job is pending execution for job 6")
        return SimpleNamespace(returncode=0, stdout=state["line"], stderr="")

    assert slurm_control.requeue_job("6", runner) == ""
    assert calls == [["scontrol", "requeue", "6"], ["scontrol", "show", "job", "-o", "6"]]
    state["line"] = SHOW_JOB["running"]
    assert "pending execution" in slurm_control.requeue_job("6", runner)
    assert slurm_control.requeue_job("", runner).startswith("no Slurm job id")
    assert slurm_control.requeue_job("5", answer("", rc=0)) == ""


def test_slurm_control_is_torch_free_and_preemption_uses_it() -> None:
    code = ("import sys, trainers.jobenv.slurm, hpcjobs.protocol.settings.trainflags, trainers.launch; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]"
    assert not hasattr(preemption, "requeue_job")  # it asks trainers.jobenv, whose Slurm job runs these
    assert not hasattr(preemption, "job_end") and not hasattr(preemption, "signal_due")  # the contract's now


# --- the preemption protocol takes the contract ------------------------------------------------------------------

def test_no_preemption_default_or_untyped_variable_is_written_in_trainers() -> None:
    """The defaults live in hpcjobs.protocol.contract only; the launcher exports the contract, not loose variables."""
    banned = {*REMOVED_VARIABLES, DEFAULTS.signal, f"SIG{DEFAULTS.signal}"}
    found = []
    for path in sorted((REPO / "trainers").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in banned:
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}")
    assert not found


def test_stop_guard_reads_the_contract_when_made_not_at_import(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                               clean_preemption: None) -> None:
    """A USR1 profile: StopGuard made after trainers.preemption was imported must handle USR1 (it defaulted to
    USR2 when the module read the signal at import)."""
    usr1 = LaunchContract(run_dir=str(tmp_path), preemption=Preemption(signal="USR1", max_restarts=3))
    monkeypatch.setenv(ENV_VAR, usr1.to_json())
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    guard = preemption.StopGuard()
    assert guard.contract == usr1
    assert signal.getsignal(signal.SIGUSR1) is preemption._handler
    os.kill(os.getpid(), signal.SIGUSR1)
    assert preemption.requested_locally() and preemption.first_request()[0] == "SIGUSR1"


def test_stop_guard_outside_a_launched_rank_uses_the_defaults_and_writes_nothing(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, clean_preemption: None) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.chdir(tmp_path)
    for var in ("SLURM_JOB_ID", "SLURM_JOB_END_TIME", "RANK", "HPCJOBS_RESTART"):
        monkeypatch.delenv(var, raising=False)
    guard = preemption.StopGuard()
    assert guard.contract == LaunchContract(run_dir=preemption.NO_RUN_FOLDER)
    assert guard.contract.preemption == DEFAULTS
    assert signal.getsignal(preemption.signal_number(DEFAULTS.signal)) is preemption._handler
    preemption.request_stop(signal.SIGINT)
    with pytest.raises(SystemExit) as stopped:
        guard.requeue_and_exit(7)
    assert stopped.value.code == 0 and list(tmp_path.iterdir()) == []  # no run folder: nothing recorded anywhere
    assert preemption.StopGuard(signal_name="SIGUSR1").launch_contract.preemption.signal == "USR1"


def test_install_arms_the_deadline_from_the_contract(clean_preemption: None) -> None:
    contract = LaunchContract(run_dir="r", preemption=Preemption(signal="USR1", seconds_before=30),
                              time_limit_s=600, start_time=1000.0)
    nums = preemption.install(contract, {"SLURM_JOB_ID": "9"})
    assert nums == sorted({signal.SIGUSR1, signal.SIGTERM, signal.SIGINT})
    armed = [(due, job.scheduler_job_id(), warn) for due, job, warn in filter(None, [preemption.STATE.deadline])]
    assert armed == [(1000.0 + 600 - 30, "9", 30)]
    preemption.install(contract, {})  # not under Slurm (a local --time): the same deadline, no job to ask
    armed = [(due, job.scheduler_job_id(), warn) for due, job, warn in filter(None, [preemption.STATE.deadline])]
    assert armed == [(1000.0 + 600 - 30, "", 30)]
    preemption.install(dataclasses.replace(contract, time_limit_s=0), {})  # no time limit: no deadline
    assert preemption.STATE.deadline is None


def _stop(tmp_path: Path, env: dict[str, str], runner: Callable[..., Any], signum: int = signal.SIGUSR1,
          **pre: Any) -> tuple[StopOutcome, list[dict[str, Any]], Any]:
    contract = LaunchContract(run_dir=str(tmp_path), preemption=Preemption(signal="USR1", **pre))
    preemption.request_stop(signum)
    outcome = preemption.finish_stop(12, contract, {"RANK": "0", **env}, runner)
    lines = [json.loads(x) for x in (tmp_path / "restarts.jsonl").read_text().splitlines()]
    final = json.loads((tmp_path / "final.json").read_text()) if (tmp_path / "final.json").exists() else None
    return outcome, lines, final


def test_finish_stop_requeues_under_the_contracts_cap(tmp_path: Path, clean_preemption: None) -> None:
    calls: list[list[str]] = []
    outcome, lines, final = _stop(tmp_path, {"SLURM_JOB_ID": "5", "HPCJOBS_RESTART": "1"},
                                  answer("", calls=calls), max_restarts=2)
    assert outcome == StopOutcome.REQUEUED and calls == [["scontrol", "requeue", "5"]] and final is None
    assert lines[-1]["stopped"] == str(StopReason.PREEMPTION) == "preemption"  # the word the submit side reads
    assert lines[-1]["signal"] == "SIGUSR1" and lines[-1]["step"] == 12


def test_finish_stop_at_the_cap_ends_the_job_failed(tmp_path: Path, clean_preemption: None) -> None:
    """Two requeues in a row brought no checkpoint newer than step 12 (tests/test_restart_cap.py: the counting)."""
    calls: list[list[str]] = []
    (tmp_path / "checkpoints" / "step-12").mkdir(parents=True)
    restartcap.record(RunFolder(tmp_path), "5", *(restartcap.Requeue(n, 12, "preemption") for n in (1, 2)))
    outcome, lines, final = _stop(tmp_path, {"SLURM_JOB_ID": "5", "HPCJOBS_RESTART": "2",
                                             "SLURM_RESTART_COUNT": "2"}, answer("", calls=calls), max_restarts=2)
    assert outcome == StopOutcome.CAP and calls == []
    assert final["state"] == str(FinalState.FAILED) == "failed" and final["step"] == 12
    assert final["reason"].startswith("restart cap 2 reached (preemption): 2 requeues in a row brought no checkpoint")


def test_finish_stop_sigterm_asks_slurm_why(tmp_path: Path, clean_preemption: None) -> None:
    calls: list[list[str]] = []
    outcome, lines, _ = _stop(tmp_path, {"SLURM_JOB_ID": "3"}, answer(SHOW_JOB["grace"], calls=calls),
                              signum=signal.SIGTERM)
    assert outcome == StopOutcome.REQUEUED and lines[-1]["stopped"] == "preemption"
    assert calls == [["scontrol", "show", "job", "-o", "3"], ["scontrol", "requeue", "3"]]
    preemption.reset()
    outcome, lines, _ = _stop(tmp_path, {"SLURM_JOB_ID": "1"}, answer(SHOW_JOB["scancel"]), signum=signal.SIGTERM)
    assert outcome == StopOutcome.STOPPED and lines[-1]["stopped"] == "terminated"


def test_finish_stop_of_a_local_run(tmp_path: Path, clean_preemption: None) -> None:
    outcome, lines, final = _stop(tmp_path, {}, answer(""), signum=signal.SIGINT)
    assert outcome == StopOutcome.LOCAL and lines[-1]["stopped"] == "interrupt" and final is None


def test_a_lost_signal_is_named_from_the_contract(tmp_path: Path, clean_preemption: None,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    contract = LaunchContract(run_dir=str(tmp_path), preemption=Preemption(signal="USR1", seconds_before=30),
                              time_limit_s=60, start_time=1000.0)
    preemption.install(contract, {"SLURM_JOB_ID": "5"})
    assert preemption.requested_locally(2000.0, answer(""))
    preemption.finish_stop(3, contract, {"SLURM_JOB_ID": "5", "RANK": "0"}, answer(""))
    assert "the USR1 signal due before the time limit never came" in capsys.readouterr().out
    assert json.loads((tmp_path / "restarts.jsonl").read_text())["stopped"] == "timeout"


# --- trainers.launch reads the contract once ---------------------------------------------------------------------

PROBE = """import json, os, signal, sys
from hpcjobs.protocol.contract import LaunchContract
c = LaunchContract.current()
print(json.dumps({"contract": c.to_json(), "loose": sorted(v for v in os.environ if v in sys.argv[1:]),
                  "usr1": signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, None),
                  "run_dir": os.environ.get("HPCJOBS_RUN_DIR")}))
"""


def launch(args: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HPCJOBS_", "RANK", "WORLD_SIZE"))}
    return subprocess.run([sys.executable, "-m", "trainers.launch", *args], capture_output=True, text=True,
                          cwd=REPO, env={**clean, **env}, timeout=120)


def test_the_launcher_resolves_stamps_and_exports_the_contract(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    given = LaunchContract(run_dir=str(tmp_path / "run-%j"), preemption=Preemption(signal="USR1"),
                           time_limit_s=3600)
    out = launch(["--contract", given.to_json(), "--kind", "script", "--", str(probe), *REMOVED_VARIABLES],
                 tmp_path, HPCJOBS_JOB_ID="local-7")
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    got = LaunchContract.from_json(seen["contract"])
    assert got.run_dir == str(tmp_path / "run-local-7") and got.start_time > 0
    assert dataclasses.replace(got, run_dir=given.run_dir, start_time=0.0) == given
    assert seen["loose"] == [] and seen["usr1"]
    assert seen["run_dir"] == str(tmp_path / "run-local-7")  # for the script's own outputs: resolved, as the contract
    assert (tmp_path / "run-local-7" / "logs" / "restart-0" / "rank-0.log").exists()


@pytest.mark.train
def test_the_start_time_is_the_process_start_however_long_python_took_to_reach_the_launcher(tmp_path: Path) -> None:
    """A time limit's own stop (the `deadline`) counts from this stamp: stamped when the launcher's code ran, a
    slow start (here a 3 s sitecustomize; on clusters a container or imports from NFS) made it that much late."""
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    (tmp_path / "sitecustomize.py").write_text("import time\ntime.sleep(3)\n")
    given = LaunchContract(run_dir=str(tmp_path / "run"), time_limit_s=3600)
    before = time.time()
    out = launch(["--contract", given.to_json(), "--kind", "script", "--", str(probe)], tmp_path,
                 PYTHONPATH=str(tmp_path))
    assert out.returncode == 0, out.stderr
    stamped = LaunchContract.from_json(json.loads(out.stdout.strip().splitlines()[-1])["contract"]).start_time
    assert time.time() - before >= 3  # the slow sitecustomize did run
    # /proc's boot time is whole seconds (and its start ticks 1/100 s): within 1.5 s of when the process was started,
    # not 3 s later when the launcher's code ran
    assert before - 1.5 <= stamped < before + 1.5


def test_the_launcher_by_hand_takes_a_run_dir_with_the_defaults(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    out = launch(["--run-dir", str(tmp_path / "r"), "--kind", "script", "--", str(probe)], tmp_path)
    assert out.returncode == 0, out.stderr
    got = LaunchContract.from_json(json.loads(out.stdout.strip().splitlines()[-1])["contract"])
    assert got.run_dir == str(tmp_path / "r") and got.preemption == DEFAULTS and got.time_limit_s == 0


@pytest.mark.parametrize("args,says", [
    (["--contract", "{not json", "--", "x"], "cannot be read"),
    (["--contract", '{"run_dir": ""}', "--", "x"], "names no run folder"),
    (["--contract", '{"run_dir": "r", "preemption": {"signl": "USR1"}}', "--", "x"], "cannot be read"),
    (["--contract", '{"run_dir": "r-%a"}', "--", "x"], "SLURM_ARRAY_TASK_ID"),
    (["--run-dir", "", "--", "x"], "--run-dir is empty"),
])
def test_a_bad_contract_is_one_line_and_exit_2(tmp_path: Path, args: list[str], says: str) -> None:
    out = launch(args, tmp_path)
    assert out.returncode == 2 and says in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


@pytest.mark.parametrize("args", [
    ["--", "x"],                                              # neither
    ["--contract", '{"run_dir": "r"}', "--run-dir", "r", "--", "x"],   # both
    ["--run", "r", "--", "x"],                                # an abbreviation
])
def test_the_launcher_wants_exactly_one_contract_source(tmp_path: Path, args: list[str]) -> None:
    out = launch(args, tmp_path)
    assert out.returncode == 2 and "usage:" in out.stderr


def test_the_launcher_enforces_the_contracts_restart_cap(tmp_path: Path) -> None:
    given = LaunchContract(run_dir=str(tmp_path / "r"), preemption=Preemption(max_restarts=2))
    out = launch(["--contract", given.to_json(), "--kind", "module", "--", "this_is_never_run"], tmp_path,
                 SLURM_RESTART_COUNT="3")
    assert out.returncode == 1
    final = json.loads((tmp_path / "r" / "final.json").read_text())
    assert final["state"] == "failed" and final["reason"] == (
        f"restart cap 2 reached ({restartcap.OUTSIDE}): 2 requeues in a row brought no checkpoint newer than the "
        f"beginning (none committed yet); stopped each time by: {restartcap.OUTSIDE}: not training again")


# --- hpcjobs.protocol.settings.trainflags.parse_trainer_args ----------------------------------------------------------

@pytest.mark.parametrize("args,given,valid", [
    (["--steps", "0"], "--steps 0 is too small", "--steps N with N ≥ 1"),
    (["--steps", "abc"], "--steps 'abc' is not a whole number", "--steps N with N ≥ 1"),
    (["--steps", "1.5"], "--steps '1.5' is not a whole number", "--steps N"),
    (["--steps"], "--steps has no value (it is the last argument)", "--steps N with N ≥ 1"),
    (["--steps", "--lr", "1"], "--steps has no value (it is followed by --lr)", "--steps N"),
    (["--precision", "fp8"], "--precision 'fp8' is not a choice", "--precision auto|fp32|bf16|fp16"),
    (["--keep-best"], "--keep-best without --eval-every", "--keep-best --eval-every N"),
    (["--keep", "1"], "--keep 1 is too small", "--keep N with N ≥ 2"),
    (["--lr", "x"], "--lr 'x' is not a number", "--lr X with X > 0"),
    (["--lr", "0"], "--lr 0 is too small", "--lr X with X > 0"),
    (["--lr", "nan"], "--lr 'nan' is not a finite number", "--lr X with X > 0"),
    (["--grad-accum", "0"], "--grad-accum 0 is too small", "--grad-accum N with N ≥ 1"),
    (["--lr-scaling", "cube"], "--lr-scaling 'cube' is not a choice", "--lr-scaling none|linear|sqrt"),
    (["--batch-size", "-1"], "--batch-size -1 is too small", "--batch-size N with N ≥ 1"),
    (["--batch-size=-1"], "--batch-size -1 is too small", "--batch-size N with N ≥ 1"),
    (["--min-lr-ratio", "1.5"], "--min-lr-ratio 1.5 is too large", "0 ≤ X ≤ 1"),
    (["--eval-every", "-5"], "--eval-every -5 is too small", "N ≥ 0 (0: never)"),
    (["--keep-best=yes", "--eval-every", "5"], "--keep-best=yes gives a value to a switch", "--no-keep-best"),
    (["--seed", "9" * 26], f"--seed {'9' * 26} is too large", "0 ≤ N ≤ 9223372036854775807"),  # torch's limit
    (["--seed", "1" * 5000], f"--seed '{'1' * 40}...' (5000 characters) has more digits than Python reads (4300)",
     "--seed N"),
])
def test_bad_trainer_flags_are_one_line_with_what_is_valid(args: list[str], given: str, valid: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_trainer_args(args)
    text = str(e.value)
    assert "\n" not in text and text.startswith(f"{given}; valid: ") and valid in text, text
    message, _, hint = text.partition(" HINT: ")  # as the submit side splits it
    assert message.endswith(".") and hint


def test_a_task_flag_that_is_a_prefix_of_a_trainer_flag_reaches_the_task() -> None:
    cfg, rest = parse_trainer_args(["--warmup", "5", "--step", "7"])
    assert cfg == TrainConfig() and (cfg.warmup_steps, cfg.steps) == (0, 100)
    assert rest == ["--warmup", "5", "--step", "7"]


def test_unknown_flags_pass_through_in_order() -> None:
    args = ["--size", "tiny", "--steps", "30", "-h", "--lr=0.01", "--text", "a.txt", "--tracker", "wandb,mlflow",
            "--help", "pos", "--", "--steps", "9"]
    cfg, rest = parse_trainer_args(args)
    assert (cfg.steps, cfg.lr, cfg.tracker) == (30, 0.01, "wandb,mlflow")
    assert rest == ["--size", "tiny", "-h", "--text", "a.txt", "--help", "pos", "--", "--steps", "9"]
    assert parse_trainer_args(["--steps", "3", "--steps", "4"])[0].steps == 4  # the later one wins


def test_task_defaults_sit_under_the_flags() -> None:
    cfg, _ = parse_trainer_args(["--lr", "0.5"], {"lr": 1e-3, "batch_size": 32})
    assert (cfg.lr, cfg.batch_size) == (0.5, 32)
    with pytest.raises(ConfigError, match="the task's default 'learning_rate' is not a trainer setting"):
        parse_trainer_args([], {"learning_rate": 1.0})
    with pytest.raises(ConfigError, match="the task's default batch_size=0 is too small"):
        parse_trainer_args([], {"batch_size": 0})


def test_every_numeric_setting_has_a_range() -> None:
    numeric = {f.name for f in dataclasses.fields(TrainConfig) if f.type in ("int", "float", "int | str")}
    assert numeric == {f.name for f in dataclasses.fields(TrainConfig) if "min" in f.metadata}


def test_every_schema_key_of_a_setting_is_one_the_parser_reads() -> None:
    """A misspelt key (`choises`) would leave a flag unchecked without a word: only hpcjobs.protocol.settings.schema's
    keys that the trainer's flags read are allowed, and a hint or example for every flag that takes a value."""
    known = {"choices", "multiple", "min", "max", "above", "note", "example", "hint", "shown", "resume"}
    for f in dataclasses.fields(TrainConfig):
        assert set(f.metadata) <= known, (f.name, set(f.metadata) - known)
        assert f.type == "bool" or {"hint", "example"} & set(f.metadata), f.name
        assert not f.metadata.get("multiple") or "choices" in f.metadata, f.name


def test_every_trainer_flag_has_its_row_in_the_reference_table() -> None:
    rows = {line.split(" | ")[0].strip("| `"): line for line in reference_table().splitlines()[2:]}
    assert list(rows) == ["--" + f.name.replace("_", "-") for f in dataclasses.fields(TrainConfig)]
    assert rows["--steps"] == ("| `--steps` | whole number | 100 | N ≥ 1 | Optimizer steps to train in all (a resumed "
                               "run continues up to this number). |")
    assert "| X > 0 |" in rows["--lr"] and "| one of `auto`, `fp32`, `bf16`, `fp16` |" in rows["--precision"]
    assert "| switch | true | `--meta-init` or `--no-meta-init` |" in rows["--meta-init"]


def test_the_docs_hold_exactly_the_trainer_flag_table() -> None:
    page = (REPO / "docs" / "reference" / "trainer-flags.md").read_text()
    assert f"\n\n{reference_table()}\n" in page, ("docs/reference/trainer-flags.md's table is stale: paste "
                                                   "hpcjobs.protocol.settings.trainflags.reference_table()")


def test_trainer_flags_are_never_abbreviated_anywhere() -> None:
    from trainers.tasks import classifier, lm

    for make, flag in ((lm.make_task, "--sample"), (classifier.make_task, "--hid")):  # --samples, --hidden
        with pytest.raises(TaskArgError, match="is not a flag of this task"):  # one line, not a SystemExit
            make([flag, "64"])
    for path in sorted((REPO / "trainers").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "ArgumentParser":
                keywords = {k.arg: k.value for k in node.keywords}
                assert isinstance(keywords.get("allow_abbrev"), ast.Constant), f"{path}:{node.lineno}"
                assert keywords["allow_abbrev"].value is False, f"{path}:{node.lineno}"


def test_a_bad_trainer_flag_on_a_rank_is_one_line_exit_2_and_records_nothing(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "trainers", "trainers.tasks.classifier", "--run-dir",
                          str(tmp_path / "r"), "--steps", "0"], capture_output=True, text=True, cwd=REPO,
                         env={k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HPCJOBS_"))},
                         timeout=300)
    assert out.returncode == 2, out.stdout + out.stderr
    log = (tmp_path / "r" / "logs" / "restart-0" / "rank-0.log").read_text()  # the rank's stderr goes here too
    assert "hpcjobs: --steps 0 is too small; valid: --steps N with N ≥ 1." in log and "Traceback" not in log
    assert not (tmp_path / "r" / "final.json").exists()  # a refused start is not a run's end (issue 10)
