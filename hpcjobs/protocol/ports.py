"""The rendezvous port rule, shared by the rendered script (shell arithmetic) and trainers.distenv (Python).

Every rank derives the same port from the job id without talking, two jobs sharing a node get different ports, and
the range stays above the well-known ports and below Linux's ephemeral range (32768+), where outgoing connections
take their local ports.
"""

import socket

PORT_BASE = 15000
PORT_SPAN = 15000


def port_for_job(job_id: int) -> int:
    return PORT_BASE + job_id % PORT_SPAN


def shell_port_expr(job_id_var: str = "SLURM_JOB_ID") -> str:
    """The same rule as shell arithmetic, for the sbatch template."""
    return f"$(( {PORT_BASE} + {job_id_var} % {PORT_SPAN} ))"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the local backend's rendezvous, tests)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
