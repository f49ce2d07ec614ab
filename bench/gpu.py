"""bench/gpu: the GPU smoke benchmark, one command on a machine with one CUDA GPU.

    python bench/gpu.py [--parts throughput,compile,determinism,resume] [--size large] [--steps 60]

- throughput / compile: the example LM (trainers.tasks.lm) through `hpcjobs submit --profile local --gpus 1` and
  through a bare hand-written loop (same model, fused AdamW, autocast, clipping, batch), in bf16, fp16 and fp32
  (TF32), without and with --compile: tokens/s and MFU (median of 10-step intervals after the first two).
- determinism: the trainer with and without --deterministic (bf16 and fp32): what exactness costs.
- resume: a run killed (SIGKILL) at step 27 and restarted vs the same run uninterrupted, with and without
  --deterministic: are the final weights bit-identical, and if not, by how much they differ.

Results go to bench/results/gpu-<gpu>.json (a part run again replaces its earlier figures) and a summary is
printed. Needs the project installed (the `hpcjobs` command next to this Python).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
HPCJOBS = Path(sys.executable).parent / "hpcjobs"
PRECISIONS = ("bf16", "fp16", "fp32")
INTERVAL = 10  # steps per timed interval (the trainer's --log-every)
SKIP = 2  # intervals dropped: CUDA warm-up, compilation, DDP-free but still first-touch allocations


def lm_args(size: str, batch: int, steps: int) -> list[str]:
    return ["trainers.tasks.lm", "--size", size, "--batch-size", str(batch), "--steps", str(steps),
            "--log-every", str(INTERVAL), "--ckpt-every", "0", "--seed", "1"]


def trainer_run(run: Path, args: list[str], fault: str = "") -> dict[str, Any]:
    """One local job; its median tokens/s and MFU over the timed intervals."""
    t0 = time.perf_counter()
    out = subprocess.run([str(HPCJOBS), "submit", "--profile", "local", "--gpus", "1", "--run-dir", str(run),
                          *args], capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "HPCJOBS_FAULT_INJECT": fault})
    wall = time.perf_counter() - t0
    if out.returncode != 0 and not fault:
        raise RuntimeError(f"hpcjobs submit {' '.join(args)} failed ({out.returncode}):\n{out.stdout[-3000:]}\n"
                           f"{out.stderr[-3000:]}")
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in recs if "tokens_per_s" in r][SKIP:]
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed) if timed else None,
            "mfu": statistics.median(r["mfu"] for r in timed) if timed and "mfu" in timed[0] else None,
            "wall_s": round(wall, 1), "start_line": next((line for line in out.stdout.splitlines()
                                                          if "| precision" in line), "")}


def bare_loop(size: str, batch: int, steps: int, precision: str, compiled: bool) -> dict[str, Any]:
    """What a user writes by hand for one GPU; run in its own process (math settings are process-wide)."""
    from torch.utils.data import DataLoader

    from hpcjobs.protocol.settings.trainconfig import TrainConfig
    from trainers import perf
    from trainers.tasks.lm import lm_loss, make_task
    from trainers.trainer import default_optimizer

    device = torch.device("cuda", 0)
    perf.configure_math(precision, False, device)
    task = make_task(["--size", size])
    torch.manual_seed(1)
    model = task.model().to(device)
    opt = default_optimizer(model, 1e-3, TrainConfig())
    net = torch.compile(model) if compiled else model
    scaler = torch.amp.GradScaler("cuda", enabled=precision == "fp16")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    loader = DataLoader(task.train_data(), batch_size=batch, shuffle=True, drop_last=True, pin_memory=True)
    times, step, t0 = [], 0, time.perf_counter()
    while step < steps:
        for tokens in loader:
            tokens = tokens.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                loss = lm_loss(net, tokens)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % INTERVAL == 0:
                loss.item()  # one sync per interval, as the trainer's log line
                t1 = time.perf_counter()
                times.append(t1 - t0)
                t0 = t1
            if step == steps:
                break
    tokens_s = statistics.median(INTERVAL * batch * task.tokens_per_sample / t for t in times[SKIP:])
    peak = perf.peak_flops(device, precision, tf32=precision == "fp32")
    return {"tokens_per_s": tokens_s,
            "mfu": tokens_s / task.tokens_per_sample * task.flops_per_sample / peak if peak else None}


def bare_run(size: str, batch: int, steps: int, precision: str, compiled: bool) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, "--bare", json.dumps([size, batch, steps, precision, compiled])],
                         capture_output=True, text=True, cwd=REPO)
    if out.returncode != 0:
        raise RuntimeError(f"bare loop {precision} compile={compiled} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def throughput(a: argparse.Namespace, tmp: Path, compiled: bool) -> list[dict[str, Any]]:
    rows = []
    for precision in PRECISIONS:
        args = [*lm_args(a.size, a.batch, a.steps), "--precision", precision, *(["--compile"] if compiled else [])]
        trainer = trainer_run(tmp / f"t-{precision}-{compiled}", args)
        bare = bare_run(a.size, a.batch, a.steps, precision, compiled)
        rows.append({"precision": precision, "compile": compiled, "trainer": trainer, "bare": bare,
                     "trainer_over_bare": trainer["tokens_per_s"] / bare["tokens_per_s"]})
        print(f"{precision} compile={compiled}: trainer {trainer['tokens_per_s']:,.0f} tok/s (MFU {trainer['mfu']}),"
              f" bare {bare['tokens_per_s']:,.0f} tok/s", flush=True)
    return rows


def determinism(a: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    rows = []
    for precision in ("bf16", "fp32"):
        base = [*lm_args(a.size, a.batch, a.steps), "--precision", precision]
        fast = trainer_run(tmp / f"d-{precision}-fast", base)
        exact = trainer_run(tmp / f"d-{precision}-exact", [*base, "--deterministic"])
        rows.append({"precision": precision, "tokens_per_s": fast["tokens_per_s"],
                     "deterministic_tokens_per_s": exact["tokens_per_s"],
                     "cost": 1 - exact["tokens_per_s"] / fast["tokens_per_s"]})
        print(f"determinism {precision}: {fast['tokens_per_s']:,.0f} → {exact['tokens_per_s']:,.0f} tok/s", flush=True)
    return rows


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    from trainers import checkpoint
    from trainers.checkpoint.dcp_files import model_weights

    ref = checkpoint.latest(run / "checkpoints")
    assert ref is not None
    return model_weights(ref)


def resume(a: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    """Kill at step 27 (checkpoints every 10), restart, compare with the uninterrupted run."""
    rows = []
    for deterministic in (True, False):
        args = ["trainers.tasks.lm", "--size", "medium", "--dropout", "0.1", "--steps", "40", "--ckpt-every", "10",
                "--batch-size", "16", "--seed", "2", "--precision", "bf16",
                *(["--deterministic"] if deterministic else [])]
        straight, killed = tmp / f"r-{deterministic}-straight", tmp / f"r-{deterministic}-killed"
        trainer_run(straight, args)
        trainer_run(killed, args, fault="step@27")
        trainer_run(killed, args)
        x, y = final_weights(straight), final_weights(killed)
        diff = max((x[k].float() - y[k].float()).abs().max().item() for k in x)
        rows.append({"deterministic": deterministic, "bit_identical": all(torch.equal(x[k], y[k]) for k in x),
                     "max_abs_diff": diff})
        print(f"resume deterministic={deterministic}: bit-identical {rows[-1]['bit_identical']} (max |Δ| {diff:g})",
              flush=True)
    return rows


def fsdp(a: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    """The FSDP path (issue 12): bf16, activation checkpointing, compile, against ddp on the same model; tokens/s
    and the peak GPU memory the trainer logged (metrics.jsonl's peak_mem_gib)."""
    rows = []
    for strategy, extra in (("ddp", []), ("fsdp", []), ("fsdp", ["--activation-checkpointing"]),
                            ("fsdp", ["--activation-checkpointing", "--compile"])):
        run = tmp / f"fsdp-{strategy}-{len(extra)}"
        got = trainer_run(run, [*lm_args(a.size, a.batch, a.steps), "--precision", "bf16", "--strategy", strategy,
                                *extra])
        recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        got["peak_mem_gib"] = max((r.get("peak_mem_gib", 0.0) for r in recs), default=None)
        rows.append({"strategy": strategy, "flags": extra, **got})
        print(f"{strategy} {' '.join(extra)}: {got['tokens_per_s']} tok/s, peak {got['peak_mem_gib']} GiB", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="throughput,compile,determinism,resume,fsdp")
    p.add_argument("--size", default="large")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--out", type=Path, help="results file (default bench/results/gpu-<gpu>.json)")
    p.add_argument("--bare", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.bare:
        print(json.dumps(bare_loop(*json.loads(a.bare))))
        return
    if not torch.cuda.is_available():
        sys.exit("bench/gpu.py: no CUDA GPU visible; valid: a machine where torch.cuda.is_available(). "
                 "HINT: run it on a GPU node")
    name = torch.cuda.get_device_name(0)
    out = a.out or RESULTS / f"gpu-{name.split()[1].lower() if len(name.split()) > 1 else 'cuda'}.json"
    results: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    results.update({"gpu": name, "torch": torch.__version__, "cuda": torch.version.cuda,
                    "date": time.strftime("%Y-%m-%d"), "model": f"trainers.tasks.lm --size {a.size}",
                    "batch": a.batch, "steps": a.steps})
    parts = {"throughput": lambda t: throughput(a, t, False), "compile": lambda t: throughput(a, t, True),
             "determinism": lambda t: determinism(a, t), "resume": lambda t: resume(a, t),
             "fsdp": lambda t: fsdp(a, t)}
    with tempfile.TemporaryDirectory() as tmp:
        for part in a.parts.split(","):
            t0 = time.perf_counter()
            results[part] = parts[part](Path(tmp))
            print(f"[{part}: {time.perf_counter() - t0:.0f} s]", flush=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(results, indent=1) + "\n")  # after every part: a cut-off run keeps the rest
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
