"""bench/kill_campaign: SIGKILL a local 2-rank run at random moments, again and again, restarting it each time.

Every restart must resume from the newest checkpoint that was finished when the kill came (a kill inside a save
leaves a `.step-N.tmp` that no start may load), and the final weights must be bit-identical to an uninterrupted run
of the same steps. The kill is a real SIGKILL of the whole local job, a random 0-1.5 s after rank 0 said where it
starts, so it lands anywhere: in a step, in a save, between the files of a save. Launcher and ranks are killed
together (the launcher's death alone makes the ranks stop gracefully, with a checkpoint).

    .venv/bin/python bench/kill_campaign.py [--kills 100] [--seed 0]
Writes bench/results/kill_campaign.json. tests/test_exactness.py runs a short campaign (3 kills) in CI.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "kill_campaign.json"
HPCJOBS = Path(sys.executable).parent / "hpcjobs"
STEPS_PER_KILL = 60
ARGS = ["trainers.tasks.lm", "--size", "tiny", "--dropout", "0.1", "--batch-size", "4", "--ckpt-every", "5",
        "--log-every", "50", "--seed", "3"]


def command(run: Path, steps: int) -> list[str]:
    return [str(HPCJOBS), "submit", "--profile", "local", "--gpus", "2", "--run-dir", str(run), *ARGS,
            "--steps", str(steps)]


def newest_finished(run: Path) -> int | None:
    from trainers import checkpoint

    ref = checkpoint.latest(run / "checkpoints")
    return ref.step if ref else None


def processes_of(run: Path) -> list[int]:
    """Every process whose command line names the run folder: the launcher and each rank (in its contract)."""
    needle, pids = str(run).encode(), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if needle in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids.append(int(pid))
        except OSError:
            continue
    return pids


def exited(pid: int) -> bool:
    """Whether every thread of a process has ended. A killed process's /proc/PID/cmdline reads empty as soon as its
    first thread exits, while a thread still inside a write (a save's fsync on a slow disk) keeps the process's
    files open, the run folder's lock among them: seen once in CI, where the next start was refused."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    state = re.search(r"^State:\s+(\S)", status, re.M)
    threads = re.search(r"^Threads:\s+(\d+)", status, re.M)
    return bool(state and state.group(1) in "ZX" and (not threads or int(threads.group(1)) <= 1))


def kill_all(run: Path, timeout: float = 30) -> None:
    """SIGKILL the launcher and every rank at once (the launcher's own death would only make the ranks stop
    gracefully: they save), then wait until every thread of each has ended and the run folder's lock is free."""
    from hpcjobs.protocol.folderlock import in_use
    from hpcjobs.protocol.runfolder import RunFolder

    deadline, seen = time.monotonic() + timeout, set()
    while (pids := processes_of(run)) or not all(map(exited, seen)) or in_use(RunFolder(run)):
        seen.update(pids)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes of {run} outlived SIGKILL by {timeout} s: {sorted(seen)}")
        time.sleep(0.05)


STARTED = ("resumed from", "starting at step 0")


def wait_for_start(out: Path, job: subprocess.Popen[bytes], timeout: float = 120) -> float:
    """Seconds until rank 0 said where it starts (resumed from a checkpoint, or step 0): start-up is over."""
    t0 = time.monotonic()
    while not any(word in out.read_text() for word in STARTED):
        if job.poll() is not None or time.monotonic() - t0 > timeout:
            raise RuntimeError(f"the job never started training: {out.read_text()[-2000:]}")
        time.sleep(0.05)
    return time.monotonic() - t0


def resumed_step(run: Path, restart_log: str) -> int | None:
    """The step this start said it resumed from (None: it started at step 0)."""
    m = re.search(r"resumed from \S+/step-(\d+) \(step", restart_log)
    return int(m.group(1)) if m else None


def weights(run: Path) -> dict[str, Any]:
    from trainers import checkpoint
    from trainers.checkpoint.dcp_files import model_weights

    ref = checkpoint.latest(run / "checkpoints")
    assert ref is not None
    return model_weights(ref)


def campaign(folder: Path, kills: int, seed: int) -> dict[str, Any]:
    import torch

    rng = random.Random(seed)
    steps = kills * STEPS_PER_KILL
    reference, run = folder / "reference", folder / "killed"
    subprocess.run(command(reference, steps), check=True, capture_output=True, cwd=REPO)
    records, done = [], False
    while len(records) < kills and not done:
        before = newest_finished(run)
        out = run.with_suffix(f".out-{len(records)}")
        with out.open("w") as f:
            job = subprocess.Popen(command(run, steps), stdout=f, stderr=subprocess.STDOUT, cwd=REPO,
                                   start_new_session=True)
            started = wait_for_start(out, job)
            delay = rng.uniform(0.0, 1.5)  # past start-up: anywhere in training, a save, or between a save's files
            try:
                job.wait(timeout=delay)
                done = True  # it finished first
            except subprocess.TimeoutExpired:
                kill_all(run)
                job.wait()
        said = out.read_text()
        inside_save = any(c.name.startswith(".step-") for c in (run / "checkpoints").glob(".step-*"))
        records.append({"start_s": round(started, 1), "delay_s": round(delay, 2), "newest_before": before,
                        "resumed": resumed_step(run, said), "newest_after": newest_finished(run),
                        "inside_save": inside_save, "finished": done})
        if records[-1]["resumed"] != before:
            raise AssertionError(f"kill {len(records)}: resumed from {records[-1]['resumed']}, newest finished "
                                 f"checkpoint was {before}")
    if not done:
        last = subprocess.run(command(run, steps), capture_output=True, text=True, cwd=REPO)
        assert last.returncode == 0, last.stdout[-2000:]
    a, b = weights(reference), weights(run)
    identical = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return {"kills": sum(1 for r in records if not r.get("finished")), "steps": steps, "seed": seed,
            "bit_identical": identical, "kills_inside_a_save": sum(1 for r in records if r.get("inside_save")),
            "records": records}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        result = campaign(Path(tmp), a.kills, a.seed)
    result["wall_s"] = round(time.monotonic() - t0)
    result["date"] = time.strftime("%Y-%m-%d")
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{result['kills']} kills over {result['steps']} steps; every restart resumed from the newest finished "
          f"checkpoint; final weights bit-identical: {result['bit_identical']} ({result['wall_s']} s) -> {RESULTS}")


if __name__ == "__main__":
    main()
