"""bench/checkpoint: time to save model + optimizer state (~100 MB and ~500 MB) with trainers.checkpoint, against
a raw `dd ... conv=fsync` of the same number of bytes in the same run, rounds interleaved (this machine drifts).

    .venv/bin/python bench/checkpoint.py [--dir /var/tmp/hpcjobs-bench] [--rounds 5]
Writes bench/results/checkpoint.json and prints a summary. Target: median save / median dd ≤ 1.3.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import torch

from trainers.checkpoint import save_checkpoint

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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", type=Path, default=Path("/var/tmp/hpcjobs-bench"))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--sizes-mb", type=int, nargs="+", default=[100, 500])
    ns = p.parse_args()
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
    finally:
        shutil.rmtree(ns.dir, ignore_errors=True)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"rounds": ns.rounds, "torch": torch.__version__, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
