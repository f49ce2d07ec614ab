"""bench/memory: what each rank holds under --strategy ddp and fsdp, at 1, 2 and 4 ranks (CPU, gloo).

    .venv/bin/python bench/memory.py [--size medium] [--ranks 1 2 4]
Every rank builds the LM task's model exactly as the shared trainer does (trainers.strategy.build_model and make:
under fsdp only rank 0 builds it in memory; the default AdamW), runs one optimizer step, and sums the bytes of the
parameters, gradients and optimizer state it holds (its local tensors: a DTensor counts its shard), before the
gradients are dropped; also its peak resident memory (ru_maxrss) once the model is built and sharded (what building
on rank 0 only saves: fsdp is measured with and without --meta-init) and after the step.
Writes bench/results/memory.json and prints a table. Target (issue 12): FSDP's held bytes per rank ≤ 1.15 × DDP's
/ ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

from hpcjobs.protocol.ports import free_port

RESULTS = Path(__file__).parent / "results" / "memory.json"
TARGET = 1.15


def local_bytes(tensors: Any) -> int:
    import torch
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t = t.to_local() if isinstance(t, DTensor) else t
            total += t.numel() * t.element_size()
    return total


def worker(size: str, strategy_name: str, meta_init: bool) -> None:
    import torch
    import torch.distributed as dist

    from hpcjobs.protocol.settings.trainconfig import TrainConfig
    from trainers import strategy
    from trainers.dist import distributed, release_groups
    from trainers.tasks.lm import make_task
    from trainers.trainer import default_optimizer

    task = make_task(["--size", size, "--samples", "64"])
    cfg = TrainConfig(strategy=strategy_name, batch_size=2, meta_init=meta_init)
    with distributed(group_of_one=True) as ctx:
        torch.manual_seed(0)
        model = strategy.build_model(task.model, cfg, ctx)  # fsdp: on the meta device but on rank 0
        net = strategy.make(model, ctx, cfg, "fp32").net
        built_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        optimizer = default_optimizer(model, 1e-3, cfg)
        batch = torch.stack([task.train_data()[i] for i in range(2)])
        task.loss(net, batch).backward()
        optimizer.step()
        held = {"params": local_bytes(model.parameters()), "grads": local_bytes(p.grad for p in model.parameters()),
                "optimizer": local_bytes(v for s in optimizer.state.values() for v in s.values())}
        held["total"] = sum(held.values())
        held["built_rss"] = built_rss
        held["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        n_params = sum(p.numel() for p in model.parameters())  # a DTensor's numel is the whole parameter's
        rows: list[Any] = [None] * ctx.world_size
        if dist.is_initialized() and ctx.world_size > 1:
            dist.all_gather_object(rows, held, group=ctx.control_group)
        else:
            rows = [held]
        if ctx.is_main:
            meta = strategy.from_rank0(cfg, ctx.world_size)
            print("MEMORY " + json.dumps({"strategy": strategy_name, "meta_init": meta, "ranks": ctx.world_size,
                                          "params": n_params, "per_rank": rows}), flush=True)
        del model, net, optimizer
    release_groups()


def measure(size: str, strategy: str, ranks: int, meta_init: bool = True) -> dict[str, Any]:
    env = {**os.environ, "HPCJOBS_BACKEND": "gloo", "PYTHONPATH": str(Path(__file__).parent.parent)}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
                          f"--master_port={free_port()}", __file__, "--worker", "--size", size, "--strategy",
                          strategy, *([] if meta_init else ["--no-meta-init"])],
                         capture_output=True, text=True, env=env, timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"{strategy} at {ranks} ranks failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("MEMORY "))
    return dict(json.loads(line.removeprefix("MEMORY ")))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="medium", help="trainers.tasks.lm --size (medium: 8 blocks)")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--strategy", default="ddp", help=argparse.SUPPRESS)
    p.add_argument("--no-meta-init", dest="meta_init", action="store_false", help=argparse.SUPPRESS)
    ns = p.parse_args()
    if ns.worker:
        worker(ns.size, ns.strategy, ns.meta_init)
        return
    variants = [("ddp", True), ("fsdp", True), ("fsdp", False)]  # --meta-init means nothing alone
    runs = [measure(ns.size, s, r, meta) for r in ns.ranks for s, meta in variants if meta or r > 1]
    ddp = {run["ranks"]: max(row["total"] for row in run["per_rank"]) for run in runs if run["strategy"] == "ddp"}
    print(f"lm --size {ns.size}: {runs[0]['params']:,} parameters")
    print(f"{'strategy':8} {'meta':>5} {'ranks':>5} {'params MiB':>10} {'grads MiB':>9} {'optim MiB':>9} "
          f"{'held MiB':>8} {'built RSS MiB (each rank)':>26} {'peak RSS MiB':>12} {'vs DDP/ranks':>12}")
    for run in runs:
        worst = max(run["per_rank"], key=lambda row: row["total"])  # the rank holding most
        run["held_vs_ddp_per_rank"] = worst["total"] / (ddp[run["ranks"]] / run["ranks"])
        built = " ".join(f"{row['built_rss'] / 2**20:.0f}" for row in run["per_rank"])
        print(f"{run['strategy']:8} {str(run['meta_init']):>5} {run['ranks']:>5} {worst['params'] / 2**20:>10.1f} "
              f"{worst['grads'] / 2**20:>9.1f} {worst['optimizer'] / 2**20:>9.1f} {worst['total'] / 2**20:>8.1f} "
              f"{built:>26} {max(row['peak_rss'] for row in run['per_rank']) / 2**20:>12.0f} "
              f"{run['held_vs_ddp_per_rank']:>12.3f}")
    fsdp = [run["held_vs_ddp_per_rank"] for run in runs if run["strategy"] == "fsdp"]
    summary = {"size": ns.size, "target": TARGET, "worst_fsdp_ratio": max(fsdp), "met": max(fsdp) <= TARGET,
               "runs": runs}
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"FSDP held per rank / (DDP / ranks): worst {max(fsdp):.3f} (target ≤ {TARGET}) -> {RESULTS}")


if __name__ == "__main__":
    main()
