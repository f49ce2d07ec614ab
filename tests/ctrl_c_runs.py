"""A user's script run through `hpcjobs submit` on the local profile and stopped by one Ctrl-C once it logged enough
steps: shared by the integrations' tests (tests/test_hf_trainer.py, test_lightning.py, test_accelerate_loop.py),
each with its own command line and its own way of reading the loss lines."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sized
from pathlib import Path

from conftest import BIN, hpcjobs
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


def one_account(run_dir: Path, final_step: int, losses: bool = True) -> None:
    """Issue 37: `status`, `goodput` and `compare` tell the truth of a user's script stopped once and resumed (they
    showed the stop's step or none, restarts 0, and 0 s productive): the final step, 1 restart, buckets that add up to
    each job's wall time, productive time and ETTR, and the run in `compare` with its final loss where it logs one."""
    status = json.loads(hpcjobs("status", str(run_dir), "--json").stdout)
    assert (status["state"], status["last_step"], status["restarts"]) == ("COMPLETED", final_step, 1), status
    jobs = json.loads(hpcjobs("goodput", str(run_dir), "--json").stdout)["jobs"]
    assert len(jobs) == 2, jobs  # the stopped job and the one that resumed it
    for job in jobs:
        assert abs(sum(job["buckets_s"].values()) - job["wall_s"]) < 1.0, job
        assert job["buckets_s"]["productive"] > 0 and job["ettr"] is not None, job
    logged, saving = logged_training_s(run_dir)
    productive = sum(job["buckets_s"]["productive"] for job in jobs)
    print(f"productive {productive:.3f} s (+ {saving:.3f} s in saves between steps), the script's own step times "
          f"{logged:.3f} s")
    assert abs(productive + saving - logged) <= 0.1 * logged, (productive, saving, logged, jobs)
    row = next(line for line in hpcjobs("compare", str(run_dir)).stdout.splitlines() if str(run_dir) in line)
    assert "COMPLETED" in row and f" {final_step} " in row, row
    assert not losses or row.split()[5] != "-", row  # its last loss


def logged_training_s(run_dir: Path) -> tuple[float, float]:
    """The training time the script's own clock gives (its `STEP_END t` lines, rank 0): in each start, from its first
    step's end to its last step's end (goodput books each start's first step as start-up); and the time the loop
    waited in saves between those step ends (saves.jsonl), which goodput books as checkpoint, not productive."""
    saves = [json.loads(line) for line in (run_dir / "saves.jsonl").read_text().splitlines()] \
        if (run_dir / "saves.jsonl").is_file() else []
    total = waited = 0.0
    for log in sorted(run_dir.glob("logs/restart-*/rank-0.log")):
        ends = [float(line.split()[1]) for line in log.read_text().splitlines() if line.startswith("STEP_END ")]
        if ends:
            total += ends[-1] - ends[0]
            waited += sum(s["blocking_s"] for s in saves if ends[0] <= s["time"] <= ends[-1])
    return total, waited
