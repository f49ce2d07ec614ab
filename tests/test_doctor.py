"""`hpcjobs doctor`'s Slurm checks on text recorded from the test cluster (Slurm 22.05.8), each passing and failing
for a planted reason; tests/cluster/test_doctor_cluster.py runs them against the live cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from subprocess import CompletedProcess

import pytest

from conftest import REPO, hpcjobs
from hpcjobs.backends import backend_for
from hpcjobs.backends.slurm import preflight as d
from hpcjobs.profiles.cluster_profile import load_profile
from hpcjobs.request.checks import Check, Result, exit_code, table
from hpcjobs.request.spec import JobSpec, Request, build_spec

GOLDEN = REPO / "tests" / "golden"
PARTITIONS = (GOLDEN / "testcluster-scontrol-partition.txt").read_text()  # scontrol show partition -o
NODES = (GOLDEN / "testcluster-scontrol-node.txt").read_text()  # scontrol show node -o
CONFIG = """\
AccountingStorageEnforce = none
AccountingStorageHost   = head
AccountingStorageType   = accounting_storage/slurmdbd
JobRequeue              = 1
PreemptMode             = REQUEUE
PreemptType             = preempt/partition_prio
SlurmctldParameters     = preempt_send_user_signal
AuthInfo                = cred_expire=5
SlurmdTimeout           = 60 sec
"""
ASSOC = CompletedProcess([], 0, "root||normal|\n", "")


def spec(gpus: int = 8, nodes: int = 2, time: str = "30:00", **profile: object) -> JobSpec:
    p = replace(load_profile(str(REPO / "cluster_profiles" / "testcluster.yaml")), **profile)
    return build_spec(p, Request(entry="trainers.tasks.lm", nodes=nodes, gpus=gpus, time=time),
                      backend_for(p.scheduler), workdir=REPO)


def parts() -> dict[str, dict[str, str]]:
    return d.records(PARTITIONS, "PartitionName")


def test_parsers_read_the_recorded_text() -> None:
    p, n, c = parts(), d.records(NODES, "NodeName"), d.config(CONFIG)
    assert sorted(p) == ["high", "low"] and p["low"]["MaxTime"] == "UNLIMITED" and p["low"]["GraceTime"] == "20"
    assert n["node1"]["Gres"] == "gpu:8" and n["node1"]["CPUTot"] == "16" and n["node2"]["OS"].startswith("Linux ")
    assert c["SlurmctldParameters"] == "preempt_send_user_signal"
    assert [d.gres_gpus(g) for g in ("gpu:8", "gpu:h100:8(S:0-1)", "gpu:a100:4,shard:8", "(null)", "",
                                     "gpu:h100:4(S:0,2),gpu:h100:4(S:1,3)")] == [8, 8, 4, 0, 0, 8]


def test_test_only() -> None:
    ok = d.check_test_only(CompletedProcess([], 0, "", "sbatch: Job 14 to start at 2026-11-23T08:45:28 using 2 "
                                                    "processors on nodes node[1-2] in partition low\n"))
    assert ok.result == Result.PASS and ok.found.endswith("would start at 2026-11-23T08:45:28 on node[1-2]")
    bad = d.check_test_only(CompletedProcess([], 1, "", "sbatch: error: invalid partition specified: nosuch\n"
                                                     "allocation failure: Invalid partition name specified\n"))
    assert bad.result == Result.FAIL and "invalid partition specified: nosuch" in bad.found


def test_partition() -> None:
    assert d.check_partition(spec(), parts()).result == Result.PASS
    missing = d.check_partition(replace(spec(), partition="nosuch"), parts())
    assert missing.result == Result.FAIL and missing.found == "partition 'nosuch' does not exist; valid: high, low"
    down = {**parts(), "low": {**parts()["low"], "State": "DOWN"}}
    assert d.check_partition(spec(), down).found == "low is DOWN"
    short = {**parts(), "low": {**parts()["low"], "MaxTime": "01:00:00"}}
    over = d.check_partition(spec(time="2:00:00"), short)
    assert over.result == Result.FAIL and "--time 02:00:00 is over its MaxTime 01:00:00" in over.found
    assert "--time 01:00:00 or less" in over.fix


def test_nodes() -> None:
    nodes = d.records(NODES, "NodeName")
    assert d.check_nodes(spec(), parts(), nodes).result == Result.PASS
    many = d.check_nodes(spec(gpus=16, gpus_per_node=16), parts(), nodes)
    assert many.result == Result.FAIL
    assert many.found == ("0 of 2 nodes in low have 16 GPUs and 16 CPUs and are up (they have: gpu:8 16 CPUs); the job "
                          "needs 2")
    cpus = d.check_nodes(spec(gpus=8, cpus_per_gpu=4), parts(), nodes)
    assert cpus.result == Result.FAIL and "have 8 GPUs and 32 CPUs" in cpus.found
    drained = {**nodes, "node2": {**nodes["node2"], "State": "IDLE+DRAIN"}}
    assert d.check_nodes(spec(), parts(), drained).result == Result.FAIL
    down = {**nodes, "node2": {**nodes["node2"], "State": "DOWN*"}}
    assert d.check_nodes(spec(), parts(), down).result == Result.FAIL
    cloud = {**nodes, "node2": {**nodes["node2"], "State": "IDLE+CLOUD+POWERED_DOWN"}}  # powered up on demand
    assert d.check_nodes(spec(), parts(), cloud).result == Result.PASS
    assert d.check_nodes(spec(nodes=1), parts(), drained).result == Result.PASS


def test_account() -> None:
    conf = d.config(CONFIG)
    assert d.check_account(replace(spec(), account="root", qos="normal"), conf, ASSOC).result == Result.PASS
    assert d.check_account(replace(spec(), account="ROOT"), conf, ASSOC).result == Result.PASS  # kept lower case
    wrong = replace(spec(), account="nosuch", qos="fast")
    loose = d.check_account(wrong, conf, ASSOC)
    assert loose.result == Result.SKIP and "not enforced here" in loose.found
    strict = d.check_account(wrong, {**conf, "AccountingStorageEnforce": "associations,limits,qos"}, ASSOC)
    assert strict.result == Result.FAIL
    assert strict.found == "account 'nosuch' is not one of yours (root); qos 'fast' is not one of yours (normal)"
    none = d.check_account(spec(), {"AccountingStorageType": "accounting_storage/none"}, None)
    assert none.result == Result.SKIP and none.found == "not checked: no accounting here (accounting_storage/none)"


def test_requeue_and_signal() -> None:
    conf, low = d.config(CONFIG), parts()["low"]
    assert d.check_requeue(conf, low).found == "a preemption requeues the job (PreemptMode=REQUEUE)"
    assert d.check_requeue(conf, {**low, "PreemptMode": "CANCEL"}).result == Result.FAIL
    assert d.check_signal(spec(), conf, low).found.startswith("a preemption sends SIGUSR2")
    no_user = {**conf, "SlurmctldParameters": ""}
    term = d.check_signal(spec(), no_user, low)
    assert term.result == Result.PASS and "SIGTERM, then SIGKILL after GraceTime=20 s" in term.found
    assert d.check_signal(spec(), no_user, {**low, "GraceTime": "0"}).result == Result.FAIL
    assert d.check_signal(spec(), conf, {**low, "GraceTime": "0"}).result == Result.FAIL  # the user signal too
    assert d.by_qos({**conf, "PreemptType": "preempt/qos"}).result == Result.SKIP  # type: ignore[union-attr]
    assert d.by_qos(conf) is None


def test_requeue_delay_and_node_failure() -> None:
    conf = d.config(CONFIG)
    assert d.check_requeue_delay(conf).found.startswith("a requeued job waits 6 s before it may run again")
    assert "waits 121 s" in d.check_requeue_delay({}).found and "120, the default" in d.check_requeue_delay({}).found
    fine = d.check_node_failure(spec(), conf)
    assert fine.result == Result.PASS and fine.found.startswith("SlurmdTimeout=60 s, training collectives time out "
                                                                "after 120 s")
    site = d.check_node_failure(spec(), {**conf, "SlurmdTimeout": "300 sec"})  # Slurm's default
    assert site.result == Result.FAIL and "HPCJOBS_COLLECTIVE_TIMEOUT: 360" in site.fix
    longer = d.check_node_failure(spec(env={"HPCJOBS_COLLECTIVE_TIMEOUT": "400"}), {**conf, "SlurmdTimeout": "300"})
    assert longer.result == Result.PASS


def test_the_report() -> None:
    runs = {("sbatch", "--test-only"): CompletedProcess([], 0, "", "sbatch: Job 1 to start at T using 16 processors "
                                                                  "on nodes node[1-2] in partition low"),
            ("scontrol", "show", "partition"): CompletedProcess([], 0, PARTITIONS, ""),
            ("scontrol", "show", "node"): CompletedProcess([], 0, NODES, ""),
            ("scontrol", "show", "config"): CompletedProcess([], 0, CONFIG, ""), ("sacctmgr", "-n", "-P"): ASSOC}

    def run(argv: object) -> CompletedProcess[str]:
        words = tuple(argv)  # type: ignore[call-overload]
        return next(v for k, v in runs.items() if words[: len(k)] == k)

    checks = d.doctor(spec(), "#!/bin/bash\n", run)
    assert [c.name for c in checks] == ["request", "partition", "nodes", "account", "requeue", "signal",
                                        "requeue delay", "node failure"]
    assert exit_code(checks) == 0 and table(checks).splitlines()[0].startswith("✓ request ")
    assert exit_code([*checks, replace(checks[0], result=Result.FAIL)]) == 1


def test_a_controller_that_cannot_answer_fails_the_report_without_judging_the_rest() -> None:
    """With the controller down every scontrol answer was empty, and the rows judged on nothing passed (requeue,
    signal, requeue delay: Slurm's defaults). Recorded: Slurm 22.05 with slurmctld stopped."""
    down = "slurm_load_ctl_conf error: Unable to contact slurm controller (connect failure)"
    asked: list[tuple[str, ...]] = []

    def run(argv: object) -> CompletedProcess[str]:
        asked.append(tuple(argv))  # type: ignore[call-overload]
        return CompletedProcess([], 1, "", "allocation failure: Unable to contact slurm controller (connect "
                                "failure)\n" if asked[-1][0] == "sbatch" else down + "\n")

    checks = d.doctor(spec(), "#!/bin/bash\n", run)
    assert [(c.name, c.result) for c in checks] == [("request", Result.FAIL), ("cluster", Result.FAIL)]
    assert down in checks[1].found and "scontrol ping" in checks[1].fix
    assert exit_code(checks) == 1 and not any(a[:3] == ("scontrol", "show", "partition") for a in asked)


@pytest.mark.parametrize("args,said", [
    (["--gpus", "99"], "--gpus 99"), (["--time", "soon"], "--time 'soon'"), (["--nodes", "0"], "--nodes 0")])
def test_bad_requests_are_refused_before_any_check(args: list[str], said: str) -> None:
    out = hpcjobs("doctor", "--profile", "testcluster", *args, cwd=REPO)
    assert out.returncode == 2 and out.stdout == "" and said in out.stderr and len(out.stderr.splitlines()) == 1


def test_local_doctor() -> None:
    """Without an entry the request alone is checked: no memory plan for a task the user never named (issue 38: it
    showed one for trainers.tasks.lm --size tiny); with the task named, its plan."""
    out = hpcjobs("doctor", "--profile", "local", "--gpus", "2", "--json", cwd=REPO)
    said = json.loads(out.stdout)
    assert out.returncode == 0 and [c["name"] for c in said["checks"]] == ["scheduler", "runs folder",
                                                                           "node-local tier"], said
    out = hpcjobs("doctor", "--profile", "local", "--gpus", "2", "--json", "trainers.tasks.lm", cwd=REPO)
    said = json.loads(out.stdout)
    assert out.returncode == 0 and [c["name"] for c in said["checks"]] == ["scheduler", "runs folder",
                                                                           "node-local tier", "memory plan"]
    assert said["checks"][-1]["result"] == "skip" and "declares no gpu_memory" in said["checks"][-1]["found"]


# --- --probe: the job's script and what its report says (tests/cluster/test_doctor_cluster.py runs it) -----------

def test_the_probe_script_runs_the_setup_and_the_python_check_on_one_node(tmp_path: Path) -> None:
    from hpcjobs.backends.slurm.probe import probe_script

    s = replace(spec(), profile=replace(spec().profile, setup=("module load x",), runs_dir=str(tmp_path)))
    text = probe_script(s, tmp_path / "probe" / "r.json")
    assert "#SBATCH --nodes=1\n" in text and "#SBATCH --gpus-per-node=8\n" in text and "#SBATCH --time=00:02:00" in text
    assert text.index("module load x") < text.index("for hpcjobs_python in ") < text.index('"$HPCJOBS_PYTHON" - task')
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0


@pytest.mark.parametrize("value,ok", [("eth0", True), ("eth", True), ("=eth0", True), ("=eth", False),
                                      ("ib0", False), ("eth0,ib0", False), ("^docker,lo", True)])
def test_interfaces_in_nccls_forms(value: str, ok: bool) -> None:
    from hpcjobs.backends.slurm.probe import interface_problems

    assert (interface_problems({"NCCL_SOCKET_IFNAME": value}, ["eth0", "lo"]) == []) == ok
    assert interface_problems({"GLOO_SOCKET_IFNAME": "eth"}, ["eth0", "lo"]) != []  # gloo: exact names only


REPORT = {"host": "node1", "python": "/venv/bin/python3", "torch": "2.13.0", "cuda": False, "gpus": 0, "entry": True,
          "interfaces": ["eth0", "lo"], "arguments": {"refused": [None]}}


def test_probe_rows() -> None:
    from hpcjobs.backends.slurm.probe import probe_checks

    rows = {c.name: c for c in probe_checks(spec(), "7", "COMPLETED", REPORT, "")}
    assert {name: r.result for name, r in rows.items()} == {
        "probe": Result.PASS, "runs folder": Result.PASS, "entry": Result.PASS, "arguments": Result.PASS,
        "GPUs": Result.SKIP, "interfaces": Result.PASS}
    assert rows["arguments"].found == "trainers.tasks.lm starts with its defaults on node1"
    assert rows["GPUs"].found == "not needed: HPCJOBS_BACKEND=gloo (torch sees 0 on node1)"
    gpu = replace(spec(), env={**spec().env, "HPCJOBS_BACKEND": "nccl", "GLOO_SOCKET_IFNAME": "ib0"})
    rows = {c.name: c for c in probe_checks(gpu, "7", "COMPLETED", REPORT, "")}
    assert rows["GPUs"].result == Result.FAIL and rows["GPUs"].found.startswith("torch sees 0 CUDA GPU(s) on node1")
    assert rows["interfaces"].result == Result.FAIL and "GLOO_SOCKET_IFNAME=ib0: no interface 'ib0'" in \
        rows["interfaces"].found
    failed = probe_checks(spec(), "8", "FAILED", None, "line 1\nhpcjobs: the nodes' Python (python3 -> x) ...\n")
    assert [c.result for c in failed] == [Result.FAIL]
    assert failed[0].found == "job 8 ended FAILED without a report: hpcjobs: the nodes' Python (python3 -> x) ..."
    unwritable = probe_checks(spec(), "9", "FAILED", None, None)  # not even its output file came back
    assert unwritable[0].result == Result.FAIL and "the runs folder is not writable on the nodes" in \
        unwritable[0].found


def test_the_probe_row_for_the_entrys_flags() -> None:
    """A task's flags as a rank on the node read them (trainers.run.check_task's line in the report, one per task);
    an own script's are its own business, and a task that is not there cannot be asked."""
    sized = replace(spec(), entry=replace(spec().entry, args=("--size", "huge")))
    refused = "trainers.tasks.lm: --size: invalid choice: 'huge'; valid: --size 1b|7b|large|medium|small|tiny."
    result, found, fix = arguments_row(sized, {"arguments": {"refused": [refused]}})
    assert result == Result.FAIL and found == f"a rank on node1 would refuse --size huge: {refused}"
    assert "--profile testcluster trainers.tasks.lm --help" in fix and "install what the task imports" in fix
    assert arguments_row(sized, {"arguments": {"refused": [None]}})[:2] == (
        Result.PASS, "trainers.tasks.lm starts with --size huge on node1")
    assert arguments_row(sized, {"entry": False})[:2] == (
        Result.SKIP, "not checked: trainers.tasks.lm is not importable on node1")
    older = arguments_row(sized, {"arguments": {"skipped": "the nodes' hpcjobs is older than this one: ..."}})
    assert older[0] == Result.SKIP and "older" in older[1]
    broken = arguments_row(sized, {"arguments": {"failed": "hpcjobs's trainers cannot be imported (...)"}})
    assert broken[0] == Result.FAIL and "cannot be imported" in broken[1]
    unfinished = arguments_row(sized, {"arguments": None})
    assert unfinished[0] == Result.FAIL and "never finished" in unfinished[1], unfinished
    script = replace(spec(), entry=replace(spec().entry, kind="script", target="/p/train.py", args=("--x", "1")))
    assert arguments_row(script, {})[0] == Result.SKIP


def arguments_row(s: JobSpec, report: dict[str, object]) -> tuple[Result, str, str]:
    full = {k: v for k, v in {**REPORT, **report}.items() if v is not None}
    (c,) = [c for c in probe_checks_of(s, full, "COMPLETED") if c.name == "arguments"]
    return c.result, c.found, c.fix


def sweep_spec() -> JobSpec:
    p = load_profile(str(REPO / "cluster_profiles" / "testcluster.yaml"))
    return build_spec(p, Request(entry="trainers.tasks.lm", args=("--steps", "5"), nodes=1, gpus=1, time="5:00",
                                 sweep=("size=small,tiny,medium",)), backend_for(p.scheduler), workdir=REPO)


def test_the_probe_checks_every_point_of_a_sweep() -> None:
    """Each array task runs the entry's flags and then its point's: the probe asks about each, and names the first
    the nodes would refuse; points it had no time for are said to be unchecked."""
    s = sweep_spec()
    # The submit side refuses a bundled task's bad size itself; the nodes' words stand for what only they know
    # (a user's task, a size that needs CUDA).
    found = arguments_row(s, {"arguments": {"refused": [None, "no CUDA", "no CUDA either"]}})
    assert found[:2] == (Result.FAIL, "a rank on node1 would refuse --steps 5 --size tiny: no CUDA (and 1 more of the "
                                      "3 points)")
    assert arguments_row(s, {"arguments": {"refused": [None] * 3}})[:2] == (
        Result.PASS, "trainers.tasks.lm starts with each of its 3 points' flags on node1")
    assert arguments_row(s, {"arguments": {"refused": [None]}})[:2] == (
        Result.PASS, "trainers.tasks.lm starts with the first 1 of its 3 points' flags (the rest unchecked: the probe "
                     "gives this 60 s) on node1")


def report_step(s: JobSpec, out: Path, python: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The probe script's last command (the report) as the node runs it, from a file through bash, with `python` as
    the nodes' Python."""
    from hpcjobs.backends.slurm.probe import probe_script

    text = probe_script(s, out)
    step = out.with_name("step.sh")
    step.write_text(text[text.index('"$HPCJOBS_PYTHON" - '):])
    env = {"HPCJOBS_PYTHON": python, "PATH": os.environ["PATH"], "OMP_NUM_THREADS": "1"}
    return subprocess.run(["bash", str(step)], env=env, cwd=cwd, capture_output=True, text=True, timeout=300)


def stand_in_python(tmp_path: Path, prints: str) -> str:
    """A 'nodes' Python' that runs the report's first line (TASKS) and prints `prints` (a Python expression) as
    JSON instead of running the report."""
    path = tmp_path / "python"
    path.write_text("#!/bin/sh\nexec python3 -c 'import json, sys; ns = {}; exec(sys.stdin.readline(), ns); "
                    f"print(json.dumps({prints}))' \"$@\"\n")
    path.chmod(0o755)
    return str(path)


def run_report(tmp_path: Path, s: JobSpec, cwd: Path) -> tuple[int, dict[str, object]]:
    out = tmp_path / "report.json"
    done = report_step(s, out, sys.executable, cwd)
    return done.returncode, json.loads(out.read_text()) if out.exists() else {}


@pytest.mark.train
def test_the_probes_report_step_checks_each_points_flags_with_this_python(tmp_path: Path) -> None:
    # Points the submit side would refuse (it checks a bundled task's flags), put in the spec past it: what the
    # report step does with points the nodes refuse (a user's own task's flags) is the same.
    points = tuple((("size", size),) for size in ("small", "huge", "lagre"))
    code, report = run_report(tmp_path, replace(sweep_spec(), points=points), REPO)
    assert code == 0 and report["entry"] is True and report["torch"], report
    small, huge, lagre = report["arguments"]["refused"]  # type: ignore[index]
    assert small is None and "invalid choice: 'huge'" in huge and "invalid choice: 'lagre'" in lagre, report
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json", "step.sh"]  # written whole, no .part


def test_a_task_that_kills_the_probe_on_import_keeps_the_other_rows(tmp_path: Path) -> None:
    """A task module that takes its process down (a native crash, os._exit) on import: the report written before
    the task was touched still comes back, and the arguments row says the check never finished."""
    (tmp_path / "crashes.py").write_text("import os\nos._exit(7)\n")
    s = replace(spec(), entry=replace(spec().entry, target="crashes", args=("--steps", "3")), workdir=str(tmp_path))
    code, report = run_report(tmp_path, s, tmp_path)
    assert code == 7 and report["entry"] is True and "arguments" not in report, report
    rows = {c.name: c for c in probe_checks_of(s, report, "FAILED")}
    assert rows["probe"].result == Result.PASS and rows["interfaces"].result == Result.PASS
    assert rows["arguments"].result == Result.FAIL and "never finished" in rows["arguments"].found


def probe_checks_of(s: JobSpec, report: dict[str, object], state: str) -> list[Check]:
    """The rows doctor --probe shows for probe job 7, ended in `state`, that wrote `report` and printed nothing."""
    from hpcjobs.backends.slurm.probe import probe_checks

    return probe_checks(s, "7", state, report, "")


def test_a_sweep_larger_than_one_argument_may_hold_reaches_the_node(tmp_path: Path) -> None:
    """Linux holds at most 128 KiB in one argument: 3000 points' flags (~190 KB) are in the script, not its argv."""
    p = load_profile(str(REPO / "cluster_profiles" / "testcluster.yaml"))
    lrs = ",".join(f"{1e-4 + i * 1e-9:.9f}" for i in range(3000))
    s = build_spec(p, Request(entry="trainers.tasks.lm", args=("--steps", "1000", "--batch-size", "32"), nodes=1,
                              gpus=1, time="5:00", sweep=(f"lr={lrs}",)), backend_for(p.scheduler),
                   workdir=REPO)
    python = stand_in_python(tmp_path, '[sys.argv[1:], len(ns["TASKS"]), ns["TASKS"][-1]]')
    out = report_step(s, tmp_path / "r.json", python, tmp_path)
    assert out.returncode == 0, out.stderr
    argv, count, last = json.loads(out.stdout)
    assert argv == ["-", "task", "trainers.tasks.lm", str(tmp_path / "r.json")] and count == 3000
    assert last == ["--steps", "1000", "--batch-size", "32", "--lr", lrs.rsplit(",", 1)[1]]


def test_the_probe_hands_the_entrys_flags_to_the_nodes_python_as_given(tmp_path: Path) -> None:
    """Quotes, `;`, `$`, backquotes, spaces, a newline and non-ASCII in a flag reach the report's Python unchanged."""
    from hpcjobs.backends.slurm.probe import probe_script

    args = ("--text", "a b;c'd\"e\n$HOME `x` é", "--steps", "3")
    s = replace(spec(), entry=replace(spec().entry, args=args))
    text = probe_script(s, tmp_path / "r.json")
    text.encode("ascii")  # the script is written in whatever encoding the login node's locale has
    out = report_step(s, tmp_path / "r.json", stand_in_python(tmp_path, 'ns["TASKS"]'), tmp_path)
    assert json.loads(out.stdout) == [list(args)], out.stderr
