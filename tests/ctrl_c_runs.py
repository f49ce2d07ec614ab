"""A user's script run through `hpcjobs submit` on the local profile and stopped by one Ctrl-C once it logged enough
steps: shared by the integrations' tests (tests/test_hf_trainer.py, test_lightning.py, test_accelerate_loop.py),
each with its own command line and its own way of reading the loss lines."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Sized
from pathlib import Path

from conftest import BIN
from trainers.integrations import CHECK_EVERY

EVERY = 3
"""The stop checks' spacing in these runs' step ends (HPCJOBS_STOP_CHECK_EVERY): the default, about once a second,
would not check again within their 30 short steps once the first 12 are over. 3: a stop lands on a step the test
can predict (the step end after a check: 3k + 1), never on an epoch's end (10, 20) nor the last step (30)."""
CHECKS = ["--env", f"{CHECK_EVERY}={EVERY}"]
"""`submit`'s options that give a run that spacing."""


def interrupt(argv: list[str], cwd: Path, losses: Callable[[str], Sized], after: int,
              env: dict[str, str] | None = None) -> str:
    """Run `hpcjobs ARGV` and send one Ctrl-C (SIGINT to the command, as a terminal does) once `after` steps logged;
    everything it printed."""
    proc = subprocess.Popen([str(BIN / "hpcjobs"), *argv], cwd=cwd, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    assert proc.stdout is not None
    seen, deadline = [], time.time() + 300
    while len(losses("".join(seen))) < after:
        line = proc.stdout.readline()
        assert line and time.time() < deadline, "".join(seen)[-3000:]
        seen.append(line)
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=300)
    return "".join(seen) + rest


def without_recovery(cmd: list[str]) -> list[str]:
    """A `submit` command with the job's own recovery off: a killed rank ends the job, the next command resumes it."""
    assert cmd[0] == "submit"
    return [cmd[0], "--max-recoveries", "0", *cmd[1:]]
