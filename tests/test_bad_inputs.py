"""Every bad input: one line naming what was given, what is valid and a HINT; exit code 2; nothing submitted.

A recording `sbatch` shim stands first on PATH (an argument-handling edge case, where a fake is fine): it logs any
call, so a test proves that hpcjobs never reached submission. On the real cluster the queue is checked too."""

from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path

import pytest
import yaml

from conftest import BIN, REPO, hpcjobs, sbatch_shim

GOOD = yaml.safe_load((REPO / "cluster_profiles" / "testcluster.yaml").read_text())

BAD_PROFILES = [
    ({"gpus_per_nod": 8}, "Did you mean 'gpus_per_node'"),
    ({"gpus_per_node": 0}, "gpus_per_node is 0; valid: a whole number > 0"),
    ({"gpus_per_node": "eight"}, "gpus_per_node is 'eight'"),
    ({"gpu_request": "gpu"}, "valid: one of gpus-per-node, gres, none"),
    ({"scheduler": "pbs"}, "scheduler is 'pbs'; valid: one of slurm, local"),
    ({"default_time": "4 hours"}, "is not a Slurm time"),
    ({"default_time": "3-00:00:00"}, "default_time 3-00:00:00 is above max_time"),
    ({"mem_per_gpu": "lots"}, "is not a memory size"),
    ({"nccl": {"SOCKET_IFNAME": "eth0"}}, "names starting with NCCL_"),
    ({"preemption": {"signal": "KILL"}}, "preemption.signal is 'KILL'"),
    ({"preemption": {"seconds_before": 5}}, "seconds_before is 5; valid: at least 10"),
    ({"preemption": {"max_restart": 3}}, "unknown key preemption.'max_restart'. Did you mean 'max_restarts'"),
    ({"setup": 42}, "setup is 42; valid: a list of strings"),
    ({"exclusive": "yes"}, "exclusive is 'yes'; valid: true or false"),
    ({"env": {"BAD-NAME": "x"}}, "environment names"),
    ({"cpus_per_gpu": -1}, "cpus_per_gpu is -1"),
    ({"mem_per_gpu": "9" * 30 + "T"}, "is larger than Slurm keeps"),
    ({"env": {"MASTER_PORT": "29500"}}, "those hpcjobs sets for each rank"),
    ({"default_time": "30:00", "preemption": {"seconds_before": 3600}},
     "the default_time of profile bad 00:30:00 is not longer than the preemption warning (3600 s)"),
    ({"setup": ["module load a\nrm -rf /"]}, "single-line strings"),
]

BAD_FLAGS = [
    (["--gpus", "9"], "--gpus 9 per node: nodes of profile"),
    (["--nodes", "2", "--gpus", "9"], "allows at most 2 node(s) × 8 GPUs = 16 in all: e.g. --nodes 2 --gpus 8"),
    (["--time", "9999999999-23:59:59"], "is longer than Slurm keeps"),
    (["--env", "RANK=3"], "--env sets RANK, which hpcjobs sets for each rank"),
    (["--time", "\uff11:00"], "'\uff11:00' is not a Slurm time"),  # a full-width digit: int() reads it, Slurm not
    (["--nodes", "3"], "allows at most 2"),
    (["--nodes", "0"], "--nodes 0: valid: 1 or more"),
    (["--time", "2-00:00:00"], "allows at most 1-00:00:00"),
    (["--time", "abc"], "is not a Slurm time"),
    (["--time", "99:99"], "has a field past its unit"),  # it silently became 01:40:39
    (["--time", "0:30"], "is not longer than the preemption warning"),
    (["--name", "bad name!"], "--name 'bad name!'"),
    (["--env", "1NOEQUALS"], "is not NAME=VALUE"),
    (["--env", "NOEQUALS"], "secret NOEQUALS is not set"),  # a name alone: a secret this shell lacks
    (["--gpus", "abc"], "'abc' is not a whole number"),
]


# The shared trainer's flags, checked at submit time as the node would check them (they used to wait in the queue,
# then fail there with exit 1). Each is refused by `submit` and by `render` alike.
BAD_TRAINER_FLAGS = [
    (["--steps", "0"], "--steps"),
    (["--steps", "abc"], "--steps"),
    (["--steps", "-5"], "--steps"),
    (["--steps"], "--steps"),
    (["--batch-size", "0"], "--batch-size"),
    (["--grad-accum", "0"], "--grad-accum"),
    (["--lr", "fast"], "--lr"),
    (["--precision", "fp8"], "--precision"),
    (["--lr-scaling", "cube"], "--lr-scaling"),
    (["--keep", "1"], "--keep"),
    (["--keep-best"], "--keep-best"),
    (["--eval-every", "-1"], "--eval-every"),
    (["--log-every", "0"], "--log-every"),
    (["--stop-check-every", "-1"], "--stop-check-every"),
    # the world size is known here (1 node × the profile's 8 GPUs): a batch split unevenly fails on the node
    (["--global-batch-size", "12"], "trainer flags with 8 rank(s): global_batch_size 12 does not divide by the"),
    (["--global-batch-size", "16", "--grad-accum", "4"], "the per-rank batch 2 does not divide into grad_accum=4"),
    (["--seed", "1.5"], "--seed"),
    (["--weight-decay", "x"], "--weight-decay"),
    (["--num-workers", "many"], "--num-workers"),
]

# hpcjobs' own flags typed after the entry used to go to the entry (a --dry-run that really submitted 16 ranks).
OWN_FLAGS_AFTER_ENTRY = [
    ["--steps", "40", "--dry-run"],
    ["--json"],
    ["--profile", "local"],
    ["--nodes", "1"],
    ["--gpus=8"],
    ["--time", "1:00:00"],
    ["-m"],
]


@pytest.fixture
def sbatch_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    log = tmp_path / "sbatch-calls.log"
    sbatch_shim(tmp_path, monkeypatch, f'echo "$@" >> {log}\nexit 1\n')
    return log


def _queue() -> str:
    if not os.environ.get("HPCJOBS_TEST_CLUSTER"):
        return ""
    return subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout


def assert_refused(out: subprocess.CompletedProcess[str], fragment: str, sbatch_log: Path) -> None:
    assert out.returncode == 2, (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert fragment in lines[0], lines[0]
    assert "HINT:" in lines[0]
    assert out.stdout == ""
    assert not sbatch_log.exists(), "sbatch was called"


@pytest.mark.train
@pytest.mark.parametrize("change,fragment", BAD_PROFILES, ids=[f"profile-{i}" for i in range(len(BAD_PROFILES))])
def test_bad_profile_is_refused(change: dict, fragment: str, tmp_path: Path, sbatch_log: Path) -> None:
    prof = tmp_path / "bad.yaml"
    prof.write_text(yaml.safe_dump({**GOOD, **change}))
    before = _queue()
    out = hpcjobs("submit", "--profile", str(prof), "--nodes", "2", "--gpus", "8", "trainers.tasks.lm", cwd=tmp_path)
    assert_refused(out, fragment, sbatch_log)
    assert "bad.yaml" in out.stderr
    assert _queue() == before


@pytest.mark.parametrize("flags,fragment", BAD_FLAGS, ids=[f"flags-{i}" for i in range(len(BAD_FLAGS))])
def test_impossible_request_is_refused(flags: list[str], fragment: str, sbatch_log: Path, tmp_path: Path) -> None:
    before = _queue()
    out = hpcjobs("submit", "--profile", "testcluster", *flags, "trainers.tasks.lm", "--steps", "5", cwd=REPO)
    assert_refused(out, fragment, sbatch_log)
    assert _queue() == before


def test_not_yaml(tmp_path: Path, sbatch_log: Path) -> None:
    prof = tmp_path / "broken.yaml"
    prof.write_text("partition: [low\n")
    out = hpcjobs("submit", "--profile", str(prof), "trainers.tasks.lm", cwd=tmp_path)
    assert_refused(out, "is not valid YAML", sbatch_log)


def test_top_level_list(tmp_path: Path, sbatch_log: Path) -> None:
    prof = tmp_path / "list.yaml"
    prof.write_text("- partition: low\n")
    out = hpcjobs("submit", "--profile", str(prof), "trainers.tasks.lm", cwd=tmp_path)
    assert_refused(out, "the top level is a list", sbatch_log)


@pytest.mark.parametrize("argv,fragment", [
    (["--profile", "testcluster", "nope.py"], "script 'nope.py' does not exist"),
    (["--profile", "testcluster", "no.such.module"], "task module 'no.such.module' cannot be found"),
    (["--profile", "testcluster", "-m", "no_such_pkg.train"], "-m module 'no_such_pkg.train' cannot be found"),
    (["--profile", "testcluster", "--gpu", "2", "trainers.tasks.lm"],
     "hpcjobs submit: error: unrecognized arguments: --gpu; did you mean --gpus? HINT"),
    (["--profile", "testcluster"], "the following arguments are required: ENTRY. HINT"),
    (["--profile", "testclustr", "trainers.tasks.lm"], "Did you mean 'testcluster'"),
    (["--profile", "/nowhere/x.yaml", "trainers.tasks.lm"], "does not exist"),
    (["--profile", "local", "--nodes", "2", "trainers.tasks.lm"], "with profile local (local): valid: 1"),
    (["--profile", "testcluster", "trainers.tasks.lm:nosuch"], "lm.py defines no nosuch at its top level"),
    (["--profile", "testcluster", "trainers.tasks.lm:1bad"], "'1bad' is not a Python name"),
    (["--profile", "testcluster", "trainers.task"], "task.py defines no make_task or task at its top level"),
], ids=["script", "task", "module", "flag-typo", "no-entry", "profile-name", "profile-path", "local-nodes",
        "callable", "not-a-name", "no-make-task"])
def test_bad_entry_or_profile_name(argv: list[str], fragment: str, sbatch_log: Path) -> None:
    out = hpcjobs("submit", *argv, cwd=REPO)
    assert_refused(out, fragment, sbatch_log)


def test_a_task_file_given_as_a_script_is_refused_with_its_module_name(tmp_path: Path, sbatch_log: Path) -> None:
    """Run as a script, the task's file only defined make_task: nothing trained, exit 0, no word (issue 25). From
    the repository and from elsewhere (the module found on sys.path), the hint names the module; nothing written."""
    # From elsewhere the ranks import `trainers` from where it is installed: this very file under an editable
    # install (a developer's), a copy in site-packages otherwise (CI), which is no module name for this file.
    where = subprocess.run([str(BIN / "python"), "-c", "import importlib.util as u; print(u.find_spec('trainers')."
                            "origin)"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    installed_here = Path(where).resolve() == (REPO / "trainers" / "__init__.py").resolve()
    for cwd, entry in ((REPO, "trainers/tasks/lm.py"), (tmp_path, str(REPO / "trainers" / "tasks" / "lm.py"))):
        out = hpcjobs("submit", "--profile", "local", "--run-dir", str(tmp_path / "run"), entry, "--steps", "5",
                      cwd=cwd)
        named = cwd == REPO or installed_here
        assert_refused(out, "HINT: name the task by its module: `hpcjobs submit ... trainers.tasks.lm --steps 5`"
                       if named else "HINT: name the task by its module, submitting from the folder", sbatch_log)
        assert "defines make_task (a task for the shared trainer) and does nothing when run as a script" in out.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "hpcjobs-home").exists()  # no run folder, no record
    (tmp_path / "mytask.py").write_text("from trainers.task import Task\ntry:\n    import yaml\nexcept ImportError:"
                                        "\n    yaml = None\n\n\ndef make_task(args):\n    ...\n")
    out = hpcjobs("submit", "--profile", "local", "mytask.py", cwd=tmp_path)
    assert_refused(out, "HINT: name the task by its module: `hpcjobs submit ... mytask`", sbatch_log)


@pytest.mark.parametrize("source", [
    "def make_task(args):\n    ...\n\n\nif __name__ == '__main__':\n    print('trains')\n",
    "def make_task(args):\n    ...\n\n\nprint('trains')\n",
    "task = 'classify'\nfor step in range(3):\n    pass\n",
    "def main():\n    ...\n",  # defines no task: a script that does nothing is its own business
    "def make_task(:\n",  # does not parse: Python says so on the node, as it would for any script
])
def test_a_script_that_does_something_is_never_taken_for_a_task_file(tmp_path: Path, source: str) -> None:
    (tmp_path / "train.py").write_text(source)
    out = hpcjobs("submit", "--profile", "local", "--dry-run", "train.py", cwd=tmp_path)
    assert out.returncode == 0, out.stderr


def test_render_refuses_to_overwrite(tmp_path: Path, sbatch_log: Path) -> None:
    target = tmp_path / "job.sbatch"
    target.write_text("precious\n")
    out = hpcjobs("render", "--profile", "testcluster", "-o", str(target), "trainers.tasks.lm", cwd=REPO)
    assert_refused(out, "already exists; nothing was written", sbatch_log)
    assert target.read_text() == "precious\n"


PATH_CASES = [
    ("submit", ["--dry-run", "--run-dir", "LOOP", "trainers.tasks.lm"], "/LOOP' is a symlink loop"),
    ("submit", ["--dry-run", "--run-dir", "FILE", "trainers.tasks.lm"], "FILE is a file, not a folder"),
    ("render", ["--run-dir", "FILE/run", "trainers.tasks.lm"], "FILE is a file, not a folder"),
    ("submit", ["--dry-run", "LOOP.py"], "/LOOP.py' is a symlink loop"),
    ("submit", ["--dry-run", "a" * 256 + ".py"], "cannot be looked up (File name too long)"),
    ("render", ["-o", "DANGLING", "trainers.tasks.lm"], "DANGLING already exists; nothing was written"),
    ("render", ["-o", "FILE/x.sbatch", "trainers.tasks.lm"], "FILE is a file, not a folder; nothing was written"),
]


@pytest.mark.parametrize("command,args,fragment", PATH_CASES, ids=[f"paths-{i}" for i in range(len(PATH_CASES))])
def test_a_path_the_system_cannot_use_is_one_line(command: str, args: list[str], fragment: str, tmp_path: Path,
                                                   sbatch_log: Path) -> None:
    """A symlink loop, a name over 255 bytes, a file on the way, a link that leads nowhere: each was a traceback,
    a success that the real submission then refused, or a file written over (found by a bad-input probe)."""
    (tmp_path / "FILE").write_text("precious\n")
    for name, target in (("LOOP", "LOOP"), ("LOOP.py", "LOOP.py"), ("DANGLING", "nowhere")):
        (tmp_path / name).symlink_to(target)
    out = hpcjobs(command, "--profile", "testcluster", "--run-dir", str(tmp_path / "runs" / "x"), *args, cwd=tmp_path)
    assert_refused(out, fragment, sbatch_log)
    assert (tmp_path / "FILE").read_text() == "precious\n" and (tmp_path / "DANGLING").is_symlink()
    assert not (tmp_path / "runs").exists()  # no code snapshot copied for a refused request


def test_render_with_local_profile(sbatch_log: Path) -> None:
    out = hpcjobs("render", "--profile", "local", "trainers.tasks.lm", cwd=REPO)
    assert_refused(out, "there is no sbatch script to render", sbatch_log)


def test_sbatch_refusal_is_a_runtime_failure(tmp_path: Path, sbatch_log: Path) -> None:
    """The shim refuses like Slurm would: exit 1 and nothing recorded."""
    prof = tmp_path / "p.yaml"
    prof.write_text(yaml.safe_dump({**GOOD, "runs_dir": str(tmp_path / "runs")}))
    out = hpcjobs("submit", "--profile", str(prof), "trainers.tasks.lm", cwd=REPO)
    assert out.returncode == 1, out.stderr
    assert "sbatch refused the job" in out.stderr and "HINT:" in out.stderr
    runs = tmp_path / "runs"  # no run folder (the code snapshot may stay: another submission may share it)
    assert not runs.exists() or [p.name for p in runs.iterdir()] in ([], [".snapshots"])
    assert hpcjobs("list", "--json").stdout.strip() == "[]"


def test_submit_where_slurm_is_not_says_so_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine without Slurm's clients (a laptop, a container): one line naming them and `render` as the way on,
    nothing queued or recorded; it was submitit's 'Could not detect "srun"' traceback. The PATH holds only this
    Python's folder, so whatever this machine has installed does not decide the outcome."""
    prof = tmp_path / "p.yaml"
    prof.write_text(yaml.safe_dump({**GOOD, "runs_dir": str(tmp_path / "runs")}))
    monkeypatch.setenv("PATH", str(BIN))
    out = hpcjobs("submit", "--profile", str(prof), "trainers.tasks.lm", cwd=REPO)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "sbatch and srun not found" in out.stderr
    assert "hpcjobs render" in out.stderr
    runs = tmp_path / "runs"
    assert not runs.exists() or [p.name for p in runs.iterdir()] in ([], [".snapshots"])
    assert hpcjobs("list", "--json").stdout.strip() == "[]"


def test_sbatch_refusal_is_said_once_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Slurm's two lines for `--partition nosuch` were printed (by submitit) before hpcjobs's own, which repeated
    the second: now hpcjobs's line alone, with both."""
    sbatch_shim(tmp_path, monkeypatch, 'echo "sbatch: error: invalid partition specified: nosuch" >&2\n'
                'echo "sbatch: error: Batch job submission failed: Invalid partition name specified" >&2\nexit 1\n')
    prof = tmp_path / "p.yaml"
    prof.write_text(yaml.safe_dump({**GOOD, "runs_dir": str(tmp_path / "runs")}))
    out = hpcjobs("submit", "--profile", str(prof), "--partition", "nosuch", "trainers.tasks.lm", cwd=REPO)
    assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "invalid partition specified: nosuch; sbatch: error: Batch job submission failed" in out.stderr


def test_usage_error_is_one_line() -> None:
    out = hpcjobs("submit", "--nodes", "2", "trainers.tasks.lm")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [textwrap.dedent(out.stderr.strip())]
    assert "--profile" in out.stderr and "HINT:" in out.stderr


@pytest.mark.train
@pytest.mark.parametrize("command", ["submit", "render"])
@pytest.mark.parametrize("flags,fragment", BAD_TRAINER_FLAGS, ids=[" ".join(f) for f, _ in BAD_TRAINER_FLAGS])
def test_bad_trainer_flag_is_refused_before_queueing(command: str, flags: list[str], fragment: str,
                                                     sbatch_log: Path, tmp_path: Path) -> None:
    before = _queue()
    out_file = tmp_path / "job.sbatch"
    extra = ["-o", str(out_file)] if command == "render" else []
    out = hpcjobs(command, "--profile", "testcluster", *extra, "trainers.tasks.lm", "--size", "tiny", *flags,
                  cwd=REPO)
    assert_refused(out, fragment, sbatch_log)
    assert "trainer flag" in out.stderr
    assert not out_file.exists()
    assert _queue() == before


@pytest.mark.parametrize("args", OWN_FLAGS_AFTER_ENTRY, ids=[" ".join(a) for a in OWN_FLAGS_AFTER_ENTRY])
def test_hpcjobs_flag_after_the_entry_is_refused(args: list[str], sbatch_log: Path) -> None:
    before = _queue()
    out = hpcjobs("submit", "--profile", "testcluster", "--nodes", "2", "--gpus", "8", "trainers.tasks.lm", *args,
                  cwd=REPO)
    assert_refused(out, "comes after the entry trainers.tasks.lm", sbatch_log)
    assert "move it before the entry" in out.stderr
    assert _queue() == before


def test_a_double_dash_hands_lookalike_flags_to_the_entry(sbatch_log: Path, tmp_path: Path) -> None:
    """`train.py -- --name x` is the user saying: these are my script's flags."""
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    out = hpcjobs("submit", "--profile", "testcluster", "--dry-run", str(script), "--", "--name", "x", "--json",
                  cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "'--name', 'x', '--json'" in out.stdout or '"--name",\n' in out.stdout or "--name x --json" in out.stdout
    assert not sbatch_log.exists()


def test_hpcjobs_flags_are_never_abbreviated(sbatch_log: Path) -> None:
    out = hpcjobs("submit", "--prof", "testcluster", "trainers.tasks.lm", cwd=REPO)
    assert out.returncode == 2 and "--profile" in out.stderr and not sbatch_log.exists()
