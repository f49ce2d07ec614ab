"""bench/rank_exit: how long a rank takes to leave once its work is done, against a bare torch process's exit.

A Python process that imported torch (and torch._dynamo, which every optimizer step imports) spends ~0.6 s of CPU at
exit collecting every object it made. Every rank pays it at the end of every start, all ranks of a node at once, and
a requeued job's next start waits for the last rank to leave (Slurm's COMPLETING). trainers.launch freezes the
collector on the way out (gc.freeze at exit); this measures what is left:

  - rank: a one-rank run of the example LM by hand (`python -m trainers.launch`), from the moment its final.json was
    written (the trainer's last act) to the process's exit;
  - bare: a process that imports torch, builds a small model, takes one AdamW step and exits, from its last line to
    its exit; the same with gc.freeze at exit.

    .venv/bin/python bench/rank_exit.py [--rounds 5]
Writes bench/results/rank_exit.json and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "rank_exit.json"
REPO = Path(__file__).parent.parent
BARE = """import sys, time, atexit, gc
import torch
m = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
o = torch.optim.AdamW(m.parameters())
m(torch.ones(2, 256)).sum().backward()
o.step()
if sys.argv[1] == "freeze":
    atexit.register(gc.freeze)
print(time.time(), flush=True)
"""


def rank_exit(folder: Path) -> float:
    run = folder / "run"
    cmd = [sys.executable, "-m", "trainers.launch", "--run-dir", str(run), "--", "trainers.tasks.lm", "--size",
           "tiny", "--steps", "3", "--log-every", "1"]
    subprocess.run(cmd, check=True, cwd=REPO, capture_output=True)
    return time.time() - (run / "final.json").stat().st_mtime


def bare_exit(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", BARE, mode], check=True, capture_output=True, text=True)
    return time.time() - float(out.stdout.split()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    ns = p.parse_args()
    rows = []
    for _ in range(ns.rounds):  # interleaved: all three see the same drift
        with tempfile.TemporaryDirectory() as tmp:
            rows.append({"rank_s": rank_exit(Path(tmp)), "bare_s": bare_exit("plain"),
                         "bare_freeze_s": bare_exit("freeze")})
    summary = {key: statistics.median(row[key] for row in rows) for key in ("rank_s", "bare_s", "bare_freeze_s")}
    print(f"a rank leaves {summary['rank_s']:.3f} s after its final.json; a bare torch process's exit takes "
          f"{summary['bare_s']:.3f} s, {summary['bare_freeze_s']:.3f} s with gc.freeze (medians of {ns.rounds})")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({**summary, "rounds": rows}, indent=2))


if __name__ == "__main__":
    main()
