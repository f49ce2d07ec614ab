"""Which failures a job recovers from by itself: the task's own bug fails the same way on every start (the job ends
FAILED, with the task's line), the infrastructure's does not (a rank killed by a signal, a peer that vanished, a
collective that timed out or hung, a node that failed, a GPU that fell off the bus: the ranks start again from the
newest finished checkpoint, in the allocation when they can). Torch-free: the node side's recovery
(trainers/recover.py) and the submit side's diagnosis read the same words.
"""

from __future__ import annotations

import re

from hpcjobs.protocol.states import _Str

TIMEOUT = re.compile(r"time(d)? ?out|timeout", re.I)
PEER_LOST = re.compile(r"connection (closed|reset|refused)|broken pipe|DistBackendError|DistNetworkError|"
                       r"NCCL (communicator|error)|ncclRemoteError|ncclSystemError|\[Gloo\]|"
                       r"failed to recv|Terminated|SIGTERM|SIGKILL", re.I)
"""What a rank records when a peer went away (the collectives' and the store's words), or when it was ended."""
DEVICE_LOST = re.compile(r"uncorrectable ECC|ECC error|GPU is lost|fallen off the bus|fell off the bus|"
                         r"cudaErrorDevicesUnavailable|NVLink|Xid", re.I)
"""A device that failed under the rank (not a kernel's bug: an illegal memory access is the task's)."""
HUNG = "hung:"
"""How a rank's hang watchdog (trainers/watchdog.py) begins the failure it records; the diagnosis and the recovery
know a hang by it."""
DID_NOT_RUN = "this rank's own process did not run"
"""What a hang watchdog adds to its `hung:` record when its own process was stopped (SIGSTOP, a suspended job) or
starved, not waiting in a collective for another rank: the diagnosis names that rank as the hung one."""
HANG_EXIT = 124
"""A rank's exit code when its hang watchdog ended it (after dumping its stacks into RUN/stacks/)."""


class FaultKind(_Str):
    TASK = "task"
    """The task's own exception: it would fail the same way again."""
    INFRASTRUCTURE = "infrastructure"
    """Nobody's bug: recovered (trainers/recover.py)."""


def waited_for_another(error: str) -> bool:
    """A rank's record saying it waited for another: a collective's timeout, or its hang watchdog's word."""
    return error.startswith(HUNG) or bool(TIMEOUT.search(error))


def kind_of(error: str | None, by_scheduler: bool = False) -> FaultKind:
    """The kind of the failure a start is diagnosed with (hpcjobs.protocol.faultpolicy.diagnosis's first failure: its
    error, and whether the scheduler said it because the rank wrote nothing). None: no rank recorded anything and the
    scheduler named none (a whole node gone, every rank killed)."""
    if error is None or error.startswith(HUNG):
        return FaultKind.INFRASTRUCTURE
    if PEER_LOST.search(error) or TIMEOUT.search(error) or DEVICE_LOST.search(error):
        return FaultKind.INFRASTRUCTURE
    if by_scheduler and not error.startswith("Exited with exit code"):  # srun's `Killed`, `Segmentation fault`
        return FaultKind.INFRASTRUCTURE
    return FaultKind.TASK
