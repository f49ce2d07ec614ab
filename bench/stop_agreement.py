"""bench/stop_agreement: what the per-step stop agreement (one gloo all-reduce of one int over all ranks) costs a
training step at 2, 16 and 64 ranks, as processes on this one host.

Each rank runs `--steps` steps of `--step-ms` (a sleep: the CPU is free, as while a GPU computes) and times only the
agreement call, both as the trainer makes it (`any_rank_pipelined`: the reduce started at the previous step is read,
the next one started) and blocking (`any_rank`, what a naive loop would do). Reported: the median and 99th percentile
of the time a step spends in the call, over all ranks' steps after the first 10. Target (issue 11): ≤ 1 ms.

    .venv/bin/python bench/stop_agreement.py [--ranks 2,16,64] [--steps 200] [--step-ms 20]
Writes bench/results/stop_agreement.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainers.agreement import Agreement

RESULTS = Path(__file__).parent / "results" / "stop_agreement.json"
WARMUP = 10


def rank_main(rank: int, world: int, port: int, steps: int, step_ms: float, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.new_group(backend="gloo")  # as the trainer: a control group of its own
    times: dict[str, list[float]] = {}
    for mode in ("pipelined", "blocking"):
        agreement = Agreement(group)
        call = agreement.any_rank_pipelined if mode == "pipelined" else agreement.any_rank
        dist.barrier(group)
        spent = []
        for _ in range(steps):
            time.sleep(step_ms / 1000)
            t0 = time.perf_counter()
            call(False)
            spent.append(time.perf_counter() - t0)
        agreement.close()
        times[mode] = spent[WARMUP:]
    Path(f"{out}-{rank}").write_text(json.dumps(times))
    dist.barrier(group)
    dist.destroy_process_group()


def measure(world: int, steps: int, step_ms: float) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times")
        mp.start_processes(rank_main, args=(world, port, steps, step_ms, out), nprocs=world, start_method="fork")
        per_rank = [json.loads(Path(f"{out}-{r}").read_text()) for r in range(world)]
    row: dict[str, Any] = {"ranks": world}
    for mode in ("pipelined", "blocking"):
        ms = sorted(t * 1000 for rank in per_rank for t in rank[mode])
        row[mode] = {"median_ms": statistics.median(ms), "p99_ms": ms[int(0.99 * (len(ms) - 1))],
                     "mean_ms": statistics.fmean(ms)}
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="2,16,64")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--step-ms", type=float, default=20.0)
    a = p.parse_args()
    rows = []
    for world in (int(n) for n in a.ranks.split(",")):
        rows.append(measure(world, a.steps, a.step_ms))
        r = rows[-1]
        print(f"{world:3d} ranks: pipelined median {r['pipelined']['median_ms']:.3f} ms (p99 "
              f"{r['pipelined']['p99_ms']:.3f}), blocking median {r['blocking']['median_ms']:.3f} ms (p99 "
              f"{r['blocking']['p99_ms']:.3f})", flush=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    summary = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "torch": torch.__version__,
               "steps": a.steps, "step_ms": a.step_ms, "rows": rows}
    RESULTS.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
