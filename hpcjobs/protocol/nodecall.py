"""How the submit side names the node's launcher: by module, as text, never by import.

`LAUNCHER_MODULE` is what every rank runs (`python -m trainers.launch` in a rendered script or the local backend's
command line), and `NodeEntry` is the callable submitit pickles and runs on every task: it imports the launcher only
when called, on the node. So `hpcjobs/` never imports `trainers/` (tests/test_imports.py), and a submit pickles a
class whose module the login node already has.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
from collections.abc import Sequence

LAUNCHER_MODULE = "trainers.launch"
RECOVERY_MODULE = "trainers.recover"
NODE_PYTHON = '"$HPCJOBS_PYTHON"'
"""The nodes' Python in a command line the job script's shell expands (found by its Python check); a
`SupervisedStep` puts in the value itself."""


class NodeEntry:
    """The callable submitit runs on every task; `checkpoint` only matters if submitit's own handler fires before
    the launcher's is installed: the job is then resubmitted as is and resumes from the run folder."""

    def __init__(self, argv: Sequence[str]) -> None:
        self.argv = list(argv)

    def __call__(self) -> int:
        # submitit's runner handles SIGCONT only to log "Bypassing signal SIGCONT" into the rank's log, twice a stop
        # (measured: `scancel --signal=USR2`); its default action, continuing, is all a rank needs.
        signal.signal(signal.SIGCONT, signal.SIG_DFL)
        rc: int = importlib.import_module(LAUNCHER_MODULE).main(self.argv)
        if rc:
            raise RuntimeError(f"hpcjobs rank exited with code {rc}; see the run folder's logs")
        return rc

    def checkpoint(self, *args: object, **kwargs: object) -> object:
        from submitit.helpers import DelayedSubmission  # submitit calls this, so it is there

        return DelayedSubmission(self)


class SupervisedStep:
    """The callable submitit runs once, in the batch script (its `use_srun=False`), for a job recovered in its
    allocation: the ranks' srun step under trainers/recover.py, as the rendered script runs it, so both paths start
    every step, the first included, the same way (and the recovery can end a step that a dead node keeps from
    ending). `argv`: `srun FLAGS RANK-COMMAND`, the nodes' Python as NODE_PYTHON."""

    def __init__(self, argv: Sequence[str]) -> None:
        self.argv = list(argv)

    def __call__(self) -> int:
        python = os.environ.get("HPCJOBS_PYTHON") or sys.executable
        argv = [python if word == NODE_PYTHON else word for word in self.argv]
        rc: int = importlib.import_module(RECOVERY_MODULE).supervise(argv)
        if rc:
            raise RuntimeError(f"hpcjobs ranks exited with code {rc}; see the run folder's logs")
        return rc

    def checkpoint(self, *args: object, **kwargs: object) -> object:
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(self)
