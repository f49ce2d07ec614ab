"""bench/checkpoint: the cost of checkpoints, rounds interleaved with a raw `dd ... conv=fsync` of the same number
of bytes in the same run (this machine drifts).

    .venv/bin/python bench/checkpoint.py [--dir /var/tmp/hpcjobs-bench] [--rounds 5]
Writes bench/results/checkpoint.json and prints a summary. Two parts:
  - single-file (`trainers.checkpoint.save_checkpoint`, what users' own scripts call), ~100 MB and ~500 MB of model +
    AdamW state. Target: median save / median dd ≤ 1.3.
  - sharded (the shared trainer's `trainers.checkpoint.sharded`), 2 ranks under --strategy fsdp, ~500 MB in all
    (`--sharded-mb`), each round: a foreground save (from the state dict on: what the trainer pays), the same bytes
    by dd, a background save, DCP's own `async_save` of the same tensors, and a load (bytes each rank read, from
    /proc/self/io, against the checkpoint's size). A background save is timed twice: what it blocks training (the
    call, then the wait before the next optimizer step for the copy of what that step changes) and what the steps
    during its write lose in all against plain steps (that, plus the CPU the writer takes from training: on this
    2-core machine, whose ranks use both cores, any background write costs its CPU time); DCP's async_save is
    timed the same two ways. Targets (issue 12): sync save ≤ 1.3 × dd; a background save blocks ≤ 0.1 × the sync
    save; a rank of a 2-rank checkpoint reads ≤ 0.6 × the checkpoint's bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hpcjobs.protocol.ports import free_port
from trainers.checkpoint import CheckpointRef, save_checkpoint

RESULTS = Path(__file__).parent / "results" / "checkpoint.json"


def adam_like_state(total_bytes: int) -> dict:
    """Parameters plus two AdamW moments (fp32): 12 bytes per parameter, in layers of 4M parameters."""
    n = total_bytes // 12
    layers = [torch.randn(min(4 << 20, n - i)) for i in range(0, n, 4 << 20)]
    model = {f"layer{i}.weight": t for i, t in enumerate(layers)}
    state = {i: {"step": torch.tensor(1.0), "exp_avg": torch.randn_like(t), "exp_avg_sq": torch.rand_like(t)}
             for i, t in enumerate(layers)}
    optim = {"state": state, "param_groups": [{"lr": 1e-3, "params": list(range(len(layers)))}]}
    return {"model": model, "optimizer": optim}


def state_bytes(state: dict) -> int:
    total = sum(t.numel() * t.element_size() for t in state["model"].values())
    return total + sum(t.numel() * t.element_size() for s in state["optimizer"]["state"].values() for t in s.values())


def time_dd(folder: Path, nbytes: int) -> float:
    target = folder / "dd.bin"
    t = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={nbytes >> 20}", "conv=fsync",
                    "status=none"], check=True)
    dt = time.perf_counter() - t
    target.unlink()
    return dt


def time_save(folder: Path, state: dict, step: int) -> float:
    t = time.perf_counter()
    save_checkpoint(folder / "ckpt", step, state, {"rng": torch.get_rng_state()}, keep=2)
    return time.perf_counter() - t


def read_bytes() -> int:
    """Bytes this process has read through read() so far (/proc/self/io rchar: page cache hits included)."""
    return int(dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())["rchar"])


def sharded_worker(folder: Path, megabytes: int, rounds: int) -> None:
    """One rank of the sharded part (run under torch.distributed.run, 2 ranks)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch import nn

    from hpcjobs.protocol.settings.trainconfig import TrainConfig
    from trainers import strategy
    from trainers.checkpoint.sharded import Checkpointer
    from trainers.checkpoint.state import RngState
    from trainers.checkpoint.stateful import ModelState, OptimizerState, Stateful, gather
    from trainers.dist import distributed

    width = 2048
    layers = max(1, (megabytes << 20) // (12 * width * width))  # 12 bytes per parameter: weights + 2 moments
    with distributed(group_of_one=True) as ctx:
        torch.manual_seed(0)
        cfg = TrainConfig(strategy="fsdp")
        model = strategy.build_model(lambda: nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]), cfg,
                                     ctx)
        strategy.make(model, ctx, cfg, "fp32")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(4, width)).sum().backward()
        opt.step()
        states: dict[str, Stateful] = {"model": ModelState(model), "optimizer": OptimizerState(model, opt),
                                       "rng": RngState(ctx.device)}
        ckpt = Checkpointer(folder / "sharded", ctx, keep=2, states=states)
        x = torch.randn(64, width)

        def step() -> tuple[float, float]:
            """One training step as the trainer runs it: (its seconds, of which waiting for the save in flight to
            have copied the parameters and optimizer state, which the update is about to change)."""
            t = time.perf_counter()
            model(x).square().mean().backward()
            w = time.perf_counter()
            ckpt.before_update()
            waited = time.perf_counter() - w
            opt.step()
            opt.zero_grad(set_to_none=True)
            ctx.barrier()
            return time.perf_counter() - t, waited

        def steps_while(busy: Callable[[], bool]) -> tuple[float, float]:
            """Train until the save is done on every rank (at least one step): (seconds waited, seconds these
            steps took beyond plain ones: the waits plus the CPU the writer took from training)."""
            waited = lost = 0.0
            while True:
                dt, w = step()
                waited, lost = waited + w, lost + dt - plain
                flag = torch.tensor([float(busy())])
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ctx.control_group)  # same step count everywhere
                if not flag.item():
                    return waited, lost

        plain = statistics.median(step()[0] for _ in range(5))
        rows = []
        for r in range(rounds):
            ctx.barrier()
            t = time.perf_counter()
            ckpt.save(2 * r, {}, background=False)
            sync_s = time.perf_counter() - t
            size = sum(f.stat().st_size for f in (folder / "sharded" / f"step-{2 * r}").iterdir())
            dd_s = time_dd(folder, size) if ctx.is_main else 0.0
            ctx.barrier()
            plain = statistics.median([plain, step()[0], step()[0]])
            t = time.perf_counter()
            ckpt.save(2 * r + 1, {}, background=True)
            in_save = time.perf_counter() - t
            waited, lost = steps_while(lambda: ckpt.pending is not None and ckpt.pending.is_alive())
            ckpt.wait()
            ctx.barrier()
            async_s = time.perf_counter() - t
            # DCP's own asynchronous save of the same tensors, measured the same way.
            t = time.perf_counter()
            future = dcp.async_save(gather(states).tensors, checkpoint_id=folder / "dcp-async" / str(r),
                                    process_group=ctx.checkpoint_group)
            dcp_call = time.perf_counter() - t
            _, dcp_lost = steps_while(lambda f=future: not f.done())
            future.result()
            ctx.barrier()
            if ctx.is_main:  # the same disk footprint in every round
                shutil.rmtree(folder / "dcp-async", ignore_errors=True)
            tensors = gather(states).tensors
            before = read_bytes()
            ckpt.read_tensors(CheckpointRef(2 * r, folder / "sharded" / f"step-{2 * r}"), tensors)
            rows.append({"sync_s": sync_s, "dd_s": dd_s, "blocked_s": in_save + waited, "in_save_call_s": in_save,
                         "waited_s": waited, "lost_s": in_save + lost, "plain_step_s": plain,
                         "async_total_s": async_s, "dcp_async_call_s": dcp_call,
                         "dcp_async_lost_s": dcp_call + dcp_lost,
                         "read_bytes": read_bytes() - before, "checkpoint_bytes": size})
        everyone: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(everyone, rows, group=ctx.control_group)
        if ctx.is_main:
            print("SHARDED " + json.dumps({"layers": layers, "width": width, "ranks": ctx.world_size,
                                           "rounds": everyone}), flush=True)


def sharded(folder: Path, megabytes: int, rounds: int) -> dict[str, Any]:
    env = {**os.environ, "HPCJOBS_BACKEND": "gloo", "PYTHONPATH": str(Path(__file__).parent.parent)}
    port = free_port()
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
                          __file__, "--sharded-worker", "--dir", str(folder), "--sharded-mb", str(megabytes),
                          "--rounds", str(rounds)], capture_output=True, text=True, env=env, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"the sharded part failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    got = json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith("SHARDED ")).removeprefix("SHARDED "))
    rank0 = got["rounds"][0]

    def median(key: str, rows: list[dict[str, Any]] = rank0) -> float:
        return statistics.median(row[key] for row in rows)

    sync, dd = median("sync_s"), median("dd_s")

    def worst(key: str) -> float:  # the slower rank's median
        return max(median(key, rows) for rows in got["rounds"])

    blocked, lost, dcp_call, dcp_lost = (worst(k) for k in ("blocked_s", "lost_s", "dcp_async_call_s",
                                                            "dcp_async_lost_s"))
    read = worst("read_bytes") / median("checkpoint_bytes")
    summary = {"checkpoint_mb": round(median("checkpoint_bytes") / 2**20), "sync_s": sync, "dd_s": dd,
               "sync_vs_dd": sync / dd, "blocked_s": blocked, "blocked_vs_sync": blocked / sync,
               "lost_vs_sync": lost / sync, "dcp_async_blocked_vs_sync": dcp_call / sync,
               "dcp_async_lost_vs_sync": dcp_lost / sync,
               "async_total_s": median("async_total_s"), "read_per_rank_vs_checkpoint": read,
               "targets": {"sync_vs_dd": 1.3, "blocked_vs_sync": 0.1, "read_per_rank_vs_checkpoint": 0.6}, **got}
    print(f"sharded, 2 ranks fsdp, {summary['checkpoint_mb']} MB: sync save {sync:.3f} s vs dd {dd:.3f} s = "
          f"{sync / dd:.2f} (target ≤ 1.3); a background save blocks training {blocked:.3f} s = "
          f"{blocked / sync:.3f} × sync (target ≤ 0.1; DCP's async_save {dcp_call / sync:.3f} ×), the steps while it "
          f"writes lose {lost / sync:.2f} × sync in all (DCP's {dcp_lost / sync:.2f} ×), committed after "
          f"{summary['async_total_s']:.3f} s; a rank's load reads {read:.2f} × the checkpoint (target ≤ 0.6)",
          flush=True)
    return summary


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", type=Path, default=Path("/var/tmp/hpcjobs-bench"))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--sizes-mb", type=int, nargs="+", default=[100, 500])
    p.add_argument("--sharded-mb", type=int, default=500)
    p.add_argument("--sharded-worker", action="store_true", help=argparse.SUPPRESS)
    ns = p.parse_args()
    if ns.sharded_worker:
        sharded_worker(ns.dir, ns.sharded_mb, ns.rounds)
        from trainers.dist import release_groups

        release_groups()
        return
    ns.dir.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        for mb in ns.sizes_mb:
            state = adam_like_state(mb << 20)
            nbytes = state_bytes(state)
            dd, save = [], []
            for r in range(ns.rounds):  # interleaved: both see the same drift
                dd.append(time_dd(ns.dir, nbytes))
                save.append(time_save(ns.dir, state, r))
            row = {"size_mb": round(nbytes / 2**20), "dd_s": statistics.median(dd),
                   "save_s": statistics.median(save), "ratio": statistics.median(save) / statistics.median(dd),
                   "dd_all": dd, "save_all": save}
            rows.append(row)
            print(f"{row['size_mb']:>5} MB: save {row['save_s']:.3f} s, dd+fsync {row['dd_s']:.3f} s, "
                  f"ratio {row['ratio']:.2f} (target <= 1.3)", flush=True)
        shards = sharded(ns.dir, ns.sharded_mb, ns.rounds)
    finally:
        shutil.rmtree(ns.dir, ignore_errors=True)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"rounds": ns.rounds, "torch": torch.__version__, "rows": rows,
                                   "sharded": shards}, indent=2))


if __name__ == "__main__":
    main()
