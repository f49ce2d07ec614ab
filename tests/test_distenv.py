"""trainers.distenv: environment mapping → rank layout and rendezvous (pure)."""

from __future__ import annotations

import subprocess

import pytest

from hpcjobs.protocol.ports import port_for_job, shell_port_expr
from trainers.distenv import DistEnvError, from_environ
from trainers.jobenv.slurm import expand_nodelist


@pytest.mark.parametrize("nodelist,first,count", [
    ("node[01-03,07]", "node01", 4),
    ("a1,b[2-3]", "a1", 3),
    ("gpu-[001-128]", "gpu-001", 128),
    ("node[1-2]", "node1", 2),
    ("node[8-11]", "node8", 4),
    ("n[009-011]", "n009", 3),
    ("single", "single", 1),
    ("rack[1-2]-node[1-2]", "rack1-node1", 4),
])
def test_nodelist_forms(nodelist: str, first: str, count: int) -> None:
    hosts = expand_nodelist(nodelist)
    assert hosts[0] == first and len(hosts) == count
    env = from_environ({"SLURM_PROCID": "3", "SLURM_NTASKS": "16", "SLURM_LOCALID": "3", "SLURM_NNODES": "2",
                        "SLURM_JOB_NODELIST": nodelist, "SLURM_JOB_ID": "4242"})
    assert env.master_addr == first


def test_padded_and_unpadded_ranges_expand_exactly() -> None:
    assert expand_nodelist("node[08-11]") == ["node08", "node09", "node10", "node11"]
    assert expand_nodelist("node[8-11]") == ["node8", "node9", "node10", "node11"]


def test_slurm_layout() -> None:
    env = from_environ({"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_NNODES": "2",
                        "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "2",
                        "NCCL_DEBUG": "WARN", "UNRELATED": "x"})
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (9, 1, 16, 8)
    assert (env.master_addr, env.master_port, env.restart, env.source) == ("node1", port_for_job(77), 2, "slurm")
    assert env.as_env()["RANK"] == "9" and env.as_env()["NCCL_DEBUG"] == "WARN" and "UNRELATED" not in env.as_env()


def test_an_array_task_is_named_as_the_login_node_knows_it() -> None:
    """Issue 26: the ranks of array task 57_1 (its own Slurm id 59) recorded "59", the job store "57_1": once Slurm
    forgot the task nothing joined them and status said UNKNOWN. The port stays the task's own."""
    env = from_environ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_ID": "59", "SLURM_ARRAY_JOB_ID": "57",
                        "SLURM_ARRAY_TASK_ID": "1", "SLURM_JOB_NODELIST": "node1"})
    assert (env.job_id, env.master_port, env.as_env()["HPCJOBS_JOB_ID"]) == ("57_1", port_for_job(59), "57_1")


def test_torchrun_variables_win_over_slurm() -> None:
    env = from_environ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1234",
                        "SLURM_PROCID": "0", "SLURM_NTASKS": "1"})
    assert (env.rank, env.world_size, env.master_addr, env.master_port, env.source) == (1, 2, "h", 1234, "torchrun")


def test_single_process() -> None:
    env = from_environ({})
    assert (env.rank, env.world_size, env.master_addr, env.source) == (0, 1, "127.0.0.1", "single")


@pytest.mark.parametrize("env", [
    {"RANK": "2", "WORLD_SIZE": "2"},
    {"SLURM_PROCID": "x", "SLURM_NTASKS": "2"},
    {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "node[3-1"},
])
def test_impossible_layouts(env: dict[str, str]) -> None:
    with pytest.raises(DistEnvError):
        from_environ(env)


@pytest.mark.parametrize("job_id", [1, 42, 14999, 15000, 123456789])
def test_port_rule_same_in_shell_and_python(job_id: int) -> None:
    shell = subprocess.run(["bash", "-c", f"SLURM_JOB_ID={job_id}; echo {shell_port_expr()}"], capture_output=True,
                           text=True, check=True).stdout.strip()
    assert int(shell) == port_for_job(job_id) == from_environ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1",
                                                               "SLURM_JOB_ID": str(job_id)}).master_port
    assert 1024 < port_for_job(job_id) < 32768  # above well-known, below Linux's ephemeral range


def test_two_jobs_on_one_node_get_different_ports() -> None:
    assert len({port_for_job(j) for j in range(1000, 1100)}) == 100


def test_the_rank_variables_a_rank_exports_are_the_ones_never_inherited() -> None:
    """DistEnv.as_env() (what a rank's children and torch's env:// read) and hpcjobs.protocol.rankvars.RENDEZVOUS
    (what a new job never inherits and a profile's env: may not set) name the same variables: a variable added to
    one side only would leak a rank's identity into a job submitted from inside it, or let a profile override it.
    RENDEZVOUS has three more: torchrun's GROUP_RANK and ROLE_RANK, and the launch contract (set by the launcher)."""
    from hpcjobs.protocol.contract import ENV_VAR
    from hpcjobs.protocol.rankvars import RENDEZVOUS

    env = from_environ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "node1", "SLURM_JOB_ID": "7",
                        "NCCL_SOCKET_IFNAME": "lo", "NCCL_DEBUG": "WARN"})  # lo: an interface every host has
    exported = {k for k in env.as_env() if not k.startswith(("NCCL_", "GLOO_"))}
    assert exported <= set(RENDEZVOUS), exported - set(RENDEZVOUS)
    assert set(RENDEZVOUS) - exported == {"GROUP_RANK", "ROLE_RANK", ENV_VAR}
