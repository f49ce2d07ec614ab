"""bench/trainer_overhead: the shared trainer against a bare hand-written loop on the same model, data, seed
and ranks, runs interleaved (this machine drifts ±10% between runs).

(a) The example LM (trainers.tasks.lm, size tiny) on 2 CPU ranks (gloo), --strategy ddp against a bare DDP loop and
    --strategy fsdp against a bare FSDP2 loop (fully_shard on each block, then the root): median step-time ratio
    trainer / bare (target ≤ 1.02), and the final weights of both, which must be bit-identical.
(b) The fixed per-step overhead in ms on a tiny model whose bare step takes ~2 ms, one process, both loops in the
    same process alternately (target ≤ 0.05 ms).

(tier) The node-local tier at its default interval (`--local-ckpt-every auto`, trainers/localtier_auto.py) against
    the trainer with it off, part (a)'s LM and ranks, interleaved: ratio of mean step times (target ≤ 1.02, issue 40).
    Parts (a) run the trainer at its defaults, so the tier (auto) is in their figure too.

    .venv/bin/python bench/trainer_overhead.py [--rounds 8] [--steps 200] [--parts a a-fsdp b tier]
Writes bench/results/trainer_overhead.json and prints a summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results" / "trainer_overhead.json"
LM_ARGS = ["--size", "tiny"]
SEED, LR, BATCH = 0, 1e-3, 8


def bare_ddp(task: Any, steps: int, log_every: int, out: Path | None, batch_size: int = BATCH,
             strategy: str = "ddp") -> list[float]:
    """What users write by hand: DistributedSampler + DDP (or FSDP2) + AdamW + cosine + clipping, timed per interval.
    It borrows the trainer's seeding, parameter groups and LR formula only so that the weights can be compared."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    from hpcjobs.protocol.settings.trainconfig import TrainConfig
    from trainers.checkpoint.resume import lr_lambda
    from trainers.checkpoint.state import seed_all
    from trainers.trainer import default_optimizer

    cfg = TrainConfig(steps=steps, lr=LR, seed=SEED)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    seed_all(SEED)
    model = task.model()
    if strategy == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = default_optimizer(model, LR, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    seed_all(SEED * 100003 + rank + 1)
    net = DDP(model) if world > 1 and strategy == "ddp" else model
    data = task.train_data()
    sampler = DistributedSampler(data, world, rank, shuffle=True, seed=SEED, drop_last=True)
    step, epoch, times = 0, 0, []
    t0 = time.perf_counter()
    while step < steps:
        sampler.set_epoch(epoch)
        loader = DataLoader(data, batch_size=batch_size, sampler=sampler, drop_last=True,
                            generator=torch.Generator().manual_seed(SEED + epoch))
        for batch in loader:
            loss = task.loss(net, batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % log_every == 0:
                loss.item()
                t1 = time.perf_counter()
                times.append((t1 - t0) / log_every)
                t0 = t1
            if step == steps:
                break
        epoch += 1
    if out is not None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save(full, out)
    return times


def worker(mode: str, steps: int, log_every: int, out: Path, strategy: str) -> None:
    """One rank of part (a): the trainer or the bare loop on the example LM."""
    import torch

    from hpcjobs.protocol.runfolder import RunFolder
    from hpcjobs.protocol.settings.trainconfig import TrainConfig
    from trainers.dist import distributed
    from trainers.tasks.lm import make_task
    from trainers.trainer import train

    task = make_task(LM_ARGS)
    with distributed() as ctx:
        torch.set_num_threads(1)
        if mode == "bare":
            import torch.distributed as dist

            times = bare_ddp(task, steps, log_every, out / "bare.pt", strategy=strategy)
            if dist.get_rank() == 0:
                (out / "bare.json").write_text(json.dumps(times))
        else:
            cfg = TrainConfig(steps=steps, lr=LR, seed=SEED, batch_size=BATCH, log_every=log_every, ckpt_every=0,
                              weight_decay=0.1, strategy=strategy)
            if mode == "trainer-tier-off":  # else the tier at its default (auto)
                cfg = dataclasses.replace(cfg, local_ckpt_every=0)
            train(task, cfg, RunFolder(out / "run"), ctx)


def run_two_ranks(mode: str, steps: int, log_every: int, out: Path, strategy: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, __file__, "--worker", mode, "--steps", str(steps), "--log-every", str(log_every), "--out",
            str(out), "--strategy", strategy]
    procs = [subprocess.Popen(argv, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.DEVNULL)
             for r in range(2)]
    if any(p.wait() for p in procs):
        raise SystemExit(f"{mode} ranks failed")


def part_a(rounds: int, steps: int, log_every: int, strategy: str) -> dict[str, Any]:
    import torch

    from trainers import checkpoint
    from trainers.checkpoint.dcp_files import model_weights

    ratios, trainer_all, bare_all, identical = [], [], [], []
    for r in range(rounds):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp)
            run_two_ranks("trainer", steps, log_every, out, strategy)
            run_two_ranks("bare", steps, log_every, out, strategy)
            recs = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines()]
            t_steps = [log_every * BATCH * 2 / rec["samples_per_s"] / log_every for rec in recs][1:]
            b_steps = json.loads((out / "bare.json").read_text())[1:]
            trained = model_weights(checkpoint.latest(out / "run" / "checkpoints"))
            bare = torch.load(out / "bare.pt", weights_only=True)
            identical.append(all(torch.equal(trained[k], bare[k]) for k in bare))
        t, b = statistics.median(t_steps), statistics.median(b_steps)
        trainer_all += t_steps
        bare_all += b_steps
        ratios.append(t / b)
        print(f"  (a) {strategy} round {r}: trainer {t * 1e3:.2f} ms/step, bare {b * 1e3:.2f} ms/step, ratio "
              f"{t / b:.3f}, weights identical: {identical[-1]}", flush=True)
    return {"task": f"trainers.tasks.lm {' '.join(LM_ARGS)}", "strategy": strategy, "ranks": 2, "steps": steps,
            "trainer_ms": statistics.median(trainer_all) * 1e3, "bare_ms": statistics.median(bare_all) * 1e3,
            "ratio_median": statistics.median(ratios), "ratios": ratios, "weights_identical": all(identical)}


def part_tier(rounds: int, steps: int, log_every: int) -> dict[str, Any]:
    """The node-local tier at its default (`--local-ckpt-every auto`) against the trainer with it off, the example
    LM on 2 CPU ranks, interleaved (the order alternating): the ratio of mean step times (a mean, not a median: the
    steps a save slows are few and must count)."""
    means: dict[str, list[float]] = {"trainer": [], "trainer-tier-off": []}
    for r in range(rounds):
        for mode in (["trainer", "trainer-tier-off"] if r % 2 == 0 else ["trainer-tier-off", "trainer"]):
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp)
                run_two_ranks(mode, steps, log_every, out, "ddp")
                recs = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines()]
                means[mode].append(statistics.mean(1 / rec["samples_per_s"] * BATCH * 2 for rec in recs[1:]))
        print(f"  (tier) round {r}: auto {means['trainer'][-1] * 1e3:.2f} ms/step, off "
              f"{means['trainer-tier-off'][-1] * 1e3:.2f} ms/step", flush=True)
    ratios = [a / o for a, o in zip(means["trainer"], means["trainer-tier-off"], strict=True)]
    return {"task": f"trainers.tasks.lm {' '.join(LM_ARGS)}", "ranks": 2, "steps": steps,
            "auto_ms": [m * 1e3 for m in means["trainer"]], "off_ms": [m * 1e3 for m in means["trainer-tier-off"]],
            "ratio_median": statistics.median(ratios), "ratios": ratios,
            "ratio_of_means": statistics.mean(means["trainer"]) / statistics.mean(means["trainer-tier-off"])}


def tiny_task() -> Any:
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import TensorDataset

    from trainers.task import Task

    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(4096, 256, generator=g), torch.randint(0, 10, (4096,), generator=g))
    return Task(name="tiny-mlp", model=lambda: nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10)),
                train_data=lambda: data, loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]))


def part_b(rounds: int, steps: int, log_every: int) -> dict[str, Any]:
    import torch

    from hpcjobs.protocol.runfolder import RunFolder
    from hpcjobs.protocol.settings.trainconfig import TrainConfig
    from trainers.dist import distributed
    from trainers.trainer import train

    torch.set_num_threads(1)
    task = tiny_task()
    trainer_all, bare_all, diffs = [], [], []
    with distributed() as ctx:
        for r in range(rounds):
            with tempfile.TemporaryDirectory() as tmp:
                cfg = TrainConfig(steps=steps, lr=LR, seed=SEED, batch_size=BATCH * 8, log_every=log_every,
                                  ckpt_every=0)
                train(task, cfg, RunFolder(Path(tmp) / "run"), ctx)
                recs = [json.loads(x) for x in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
                t = [cfg.batch_size / rec["samples_per_s"] for rec in recs][1:]
            b = bare_ddp(task, steps, log_every, None, BATCH * 8)[1:]
            trainer_all += t
            bare_all += b
            diffs.append((statistics.median(t) - statistics.median(b)) * 1e3)
            print(f"  (b) round {r}: trainer {statistics.median(t) * 1e3:.4f} ms/step, bare "
                  f"{statistics.median(b) * 1e3:.4f} ms/step, overhead {diffs[-1]:+.4f} ms", flush=True)
    return {"task": "tiny MLP 256-512-10, batch 64, 1 process", "steps": steps,
            "trainer_ms": statistics.median(trainer_all) * 1e3, "bare_ms": statistics.median(bare_all) * 1e3,
            "overhead_ms_median": statistics.median(diffs), "overhead_ms_rounds": diffs}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", choices=["trainer", "trainer-tier-off", "bare"])
    p.add_argument("--out", type=Path)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--tiny-steps", type=int, default=2000)
    p.add_argument("--strategy", default="ddp", help=argparse.SUPPRESS)
    p.add_argument("--parts", nargs="+", default=["a", "a-fsdp", "b"], help="which parts to run (default: all)")
    ns = p.parse_args()
    if ns.worker:
        worker(ns.worker, ns.steps, ns.log_every, ns.out, ns.strategy)
        return
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}  # parts not run keep their results
    for part, strategy in (("a", "ddp"), ("a-fsdp", "fsdp")):
        if part in ns.parts:
            print(f"({part}) example LM, 2 CPU ranks, trainer vs bare {strategy} loop (interleaved)", flush=True)
            results[part] = part_a(ns.rounds, ns.steps, ns.log_every, strategy)
    if "tier" in ns.parts:
        print("(tier) example LM, 2 CPU ranks, the node-local tier at its default (auto) vs off (interleaved)",
              flush=True)
        results["tier"] = part_tier(ns.rounds, ns.steps, ns.log_every)
    if "b" in ns.parts:
        print("(b) fixed per-step overhead, tiny model, one process (interleaved)", flush=True)
        results["b"] = part_b(ns.rounds, ns.tiny_steps, 100)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2))
    for part in ("a", "a-fsdp"):
        if part in results:
            a = results[part]
            print(f"({part}) median ratio {a['ratio_median']:.3f} (target <= 1.02), weights identical: "
                  f"{a['weights_identical']}")
    if "tier" in results:
        t = results["tier"]
        print(f"(tier) auto / off: median of round ratios {t['ratio_median']:.3f}, ratio of means "
              f"{t['ratio_of_means']:.3f} (target <= 1.02)")
    if "b" in results:
        b = results["b"]
        print(f"(b) overhead {b['overhead_ms_median']:+.4f} ms/step on a {b['bare_ms']:.2f} ms step (target <= 0.05)")


if __name__ == "__main__":
    main()
