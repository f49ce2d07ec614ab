"""trainers.jobenv: the node side's one seam to whatever started the rank (Slurm, a torchrun-style launcher, a single
process), chosen in `current()`; and, read from the sources, that nothing else on the node side reads a scheduler's
variables or runs its commands (as tests/test_imports.py reads the imports)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hpcjobs.protocol.contract import LaunchContract, Preemption
from trainers import jobenv
from trainers.jobenv.base import JobEnvError

REPO = Path(__file__).resolve().parent.parent
SCHEDULER_WORDS = re.compile(r"\bSLURM_\w*|^(scontrol|squeue|sacct|scancel|sbatch|srun)(\s|$)")
"""A Slurm variable anywhere in a string, or a string that is a Slurm command (an argv's first word, a shell line);
a message that merely names a command (`a scancel ends it`) is prose."""
PROTOCOL_NAMING_SLURM = {
    "hpcjobs/protocol/runfolder.py": "the run-folder pattern's ids (%j, %A, %a) are named as Slurm names them on both "
                                     "sides: the submit side fills them from a job id (array_ids), the launcher from "
                                     "its environment (LaunchContract.started)",
    "hpcjobs/protocol/ports.py": "the rendered script's shell expression for the rendezvous port names $SLURM_JOB_ID",
    "hpcjobs/protocol/faultpolicy/srunwords.py": "srun's lines about the tasks it killed are read on both sides: by "
                                                 "status from the job's logs, by the recovery from its own output "
                                                 "(it names no command)",
}
"""The shared layer's files that may still name Slurm, and why; none reads a rank's environment for a Slurm fact."""


def scheduler_words(path: Path) -> list[str]:
    """`line: word` for each string in code (not a docstring or a bare string statement: those never run) that names
    a Slurm variable or command."""
    tree = ast.parse(path.read_text())
    prose = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
    return [f"{node.lineno}: {m.group(0)}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose
            for m in [SCHEDULER_WORDS.search(node.value)] if m]


def offenders(root: Path) -> dict[str, list[str]]:
    files = [p for p in sorted((root / "trainers").rglob("*.py")) if "jobenv" not in p.relative_to(root).parts]
    files += [p for p in sorted((root / "hpcjobs" / "protocol").rglob("*.py"))
              if p.relative_to(root).as_posix() not in PROTOCOL_NAMING_SLURM]
    found = {p.relative_to(root).as_posix(): scheduler_words(p) for p in files}
    return {name: words for name, words in found.items() if words}


def test_no_module_outside_the_seam_reads_a_slurm_variable_or_runs_a_slurm_command() -> None:
    assert scheduler_words(REPO / "trainers" / "jobenv" / "slurm.py")  # the check finds them at home
    assert offenders(REPO) == {}


def test_every_listed_protocol_file_still_names_slurm() -> None:
    assert all(scheduler_words(REPO / name) for name in PROTOCOL_NAMING_SLURM), "remove it: it names Slurm no more"


# --- choosing and asking ----------------------------------------------------------------------------------------

SRUN_RANK = {"SLURM_JOB_ID": "77", "SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
             "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_RESTART_COUNT": "2"}
TORCHRUN_RANK = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h",
                 "MASTER_PORT": "2950", "TORCHELASTIC_RUN_ID": "none"}


def test_current_chooses_slurm_then_a_launcher_then_a_single_process() -> None:
    envs = (SRUN_RANK, TORCHRUN_RANK, {}, {**TORCHRUN_RANK, **SRUN_RANK}, {**TORCHRUN_RANK, "SLURM_CONF": "/s.conf"})
    assert [jobenv.current(env).name for env in envs] == ["slurm", "torchrun", "single", "slurm", "torchrun"]
    srun = jobenv.current(SRUN_RANK).layout()
    assert (srun.rank, srun.local_rank, srun.world_size, srun.local_world_size, srun.source) == (9, 1, 16, 8, "slurm")
    # a launcher inside a Slurm job (hpcjobs's own for a script, torchrun in sbatch): its layout, Slurm's job
    both = jobenv.current({**TORCHRUN_RANK, **SRUN_RANK})
    assert (both.layout().rank, both.layout().source, both.scheduler_job_id(), both.requeues()) == (3, "torchrun",
                                                                                                     "77", 2)
    assert jobenv.current(TORCHRUN_RANK).rendezvous() == ("h", 2950)
    assert jobenv.current(SRUN_RANK).rendezvous()[0] == "node1"


def test_only_a_slurm_job_id_makes_a_job_the_schedulers_to_requeue() -> None:
    calls: list[list[str]] = []

    def runner(argv: list[str], **kw: Any) -> SimpleNamespace:
        calls.append(argv)
        return SimpleNamespace(returncode=0, stdout="", stderr="")

    assert jobenv.current(SRUN_RANK).requeue(runner) == "" and calls == [["scontrol", "requeue", "77"]]
    for env in (TORCHRUN_RANK, {}, {"SLURM_RESTART_COUNT": "3"}):
        job = jobenv.current(env)
        assert job.scheduler_job_id() == "" and job.requeue(runner) and job.end_time_now(runner) is None
        assert not job.preempted_with_sigterm(runner)
    assert len(calls) == 1  # nothing was asked of Slurm for a job that is not its


def test_when_a_rank_must_stop() -> None:
    contract = LaunchContract(run_dir="r", preemption=Preemption(seconds_before=60), time_limit_s=600,
                              start_time=1000.0)
    assert jobenv.current({}).signal_due(contract) == 1000 + 600 - 60  # a local --time: from the start
    assert jobenv.current({"SLURM_JOB_ID": "5", "SLURM_JOB_END_TIME": "5000"}).signal_due(contract) == 5000 - 60
    assert jobenv.current({"SLURM_JOB_ID": "5", "SLURM_JOB_END_TIME": "soon"}).stated_end() is None


def test_what_slurm_gave_the_node() -> None:
    assert jobenv.current({"SLURM_JOB_ID": "1", "SLURM_STEP_GPUS": "0,1"}).allocated_gpus() == "SLURM_STEP_GPUS=0,1"
    assert jobenv.current({"SLURM_JOB_ID": "1", "SLURM_GPUS_ON_NODE": "0"}).allocated_gpus() is None
    assert jobenv.current({"SLURM_JOB_ID": "1", "SLURM_CPUS_PER_TASK": "6"}).cpus_per_task() == 6
    assert jobenv.current({"CUDA_VISIBLE_DEVICES": "0"}).allocated_gpus() is None


@pytest.mark.parametrize("env", [{"RANK": "x", "WORLD_SIZE": "2"}, {"SLURM_PROCID": "0", "SLURM_NTASKS": "two"}])
def test_a_value_that_is_no_number_is_refused_naming_it(env: dict[str, str]) -> None:
    with pytest.raises(JobEnvError, match="is not a whole number"):
        jobenv.current(env).layout()


def test_every_job_environment_is_named_once_in_the_shared_list_and_the_last_always_applies() -> None:
    """A new scheduler is a module on each side and its name in hpcjobs/protocol/schedulers.py: the node side's list
    is exactly the modules of trainers/jobenv/ that define ENVIRONMENT, and asking ends at `single`."""
    import importlib

    from hpcjobs.protocol.schedulers import JOB_ENVIRONMENTS

    folder = Path(jobenv.__file__).parent
    assert set(JOB_ENVIRONMENTS) == {p.stem for p in folder.glob("*.py") if "\nENVIRONMENT = " in p.read_text()}
    last = importlib.import_module(f"trainers.jobenv.{JOB_ENVIRONMENTS[-1]}")
    assert last.applies({}) and type(jobenv.current({})) is last.ENVIRONMENT


def test_a_rank_outside_slurm_never_imports_hostlist() -> None:
    """Issue 41 item 8: a bare GPU machine's image lacks python-hostlist, and the node imported it at every start,
    local runs included. Only a Slurm task's node list needs it."""
    code = ("import sys\n"
            "class NoHostlist:\n"
            "    def find_spec(self, name, path, target=None):\n"
            "        if name == 'hostlist':\n"
            "            raise ImportError('no hostlist here')\n"
            "sys.meta_path.insert(0, NoHostlist())\n"
            "from trainers import jobenv\n"
            "from trainers.distenv import from_environ\n"
            "env = {'RANK': '0', 'WORLD_SIZE': '1', 'LOCAL_RANK': '0', 'MASTER_ADDR': '127.0.0.1',"
            " 'MASTER_PORT': '29500'}\n"
            "print(type(jobenv.current(env)).__name__, from_environ(env).world_size)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.split()[-1] == "1", done.stderr[-2000:]
