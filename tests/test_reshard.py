"""Resharding resume (CPU, gloo): a checkpoint written by N ranks, loaded by the trainer at M ranks with --reshard,
gives every rank exactly the saved weights and optimizer state (gathered whole and compared with the checkpoint read
offline), and the step, schedule and data position go on; without --reshard the start is refused and names the flag."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO, hpcjobs
from hpcjobs.protocol.ports import free_port

ARGS = ["trainers.tasks.lm", "--size", "tiny", "--steps", "6", "--ckpt-every", "3", "--log-every", "1",
        "--global-batch-size", "8", "--seed", "3"]

PROBE = """
import json
import sys
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from hpcjobs.protocol.contract import LaunchContract
from hpcjobs.protocol.runfolder import RunFolder
from trainers.checkpoint.dcp_files import offline_tensors
from hpcjobs.protocol.settings.trainflags import parse_trainer_args
from trainers.dist import distributed, release_groups
from trainers.task import load_task
from trainers.trainer import Training

def main() -> None:
    run, args = RunFolder(sys.argv[1]), sys.argv[2:]
    _, task_args = parse_trainer_args(args)
    task = load_task("trainers.tasks.lm", task_args)
    cfg, _ = parse_trainer_args(args, task.defaults)
    with distributed(group_of_one=True) as ctx:
        t = Training(task, cfg, run, ctx, LaunchContract(run_dir=str(run.path)))
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model, optim = get_state_dict(t.model, t.optimizer, options=full)  # a collective: every rank
        if ctx.is_main:
            ref = t.resumed_from
            saved_model, saved_optim = offline_tensors(ref.path, "model."), offline_tensors(ref.path, "optimizer.")
            got_optim = {f"state.{p}.{k}": v for p, state in optim["state"].items() for k, v in state.items()}
            bad = [k for k in saved_model if not torch.equal(saved_model[k], model[k])]
            bad += [k for k in saved_optim if not torch.equal(saved_optim[k], got_optim[k])]
            counts = [len(saved_model), len(model), len(saved_optim), len(got_optim)]
            print("PROBE", json.dumps({"position": [t.pos.step, t.pos.epoch, t.pos.micro], "counts": counts,
                                       "unequal": bad}), flush=True)


main()
release_groups()  # not left to the interpreter's shutdown, where a gloo thread may abort the process
"""


def probe(run: Path, ranks: int, *extra: str) -> dict[str, Any]:
    script = run.parent / "probe.py"
    script.write_text(PROBE)
    env = {**os.environ, "HPCJOBS_BACKEND": "gloo", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
                          f"--master_port={free_port()}", str(script), str(run), *ARGS[1:], *extra],
                         capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    line = next(line for line in out.stdout.splitlines() if line.startswith("PROBE "))
    return dict(json.loads(line.removeprefix("PROBE ")))


def written(tmp_path: Path, ranks: int, strategy: str) -> Path:
    run = tmp_path / f"written-{strategy}{ranks}" / "run"
    out = hpcjobs("submit", "--profile", "local", "--gpus", str(ranks), "--run-dir", str(run), *ARGS,
                  "--strategy", strategy, "--steps", "4", "--ckpt-every", "2", cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return run


@pytest.mark.train
@pytest.mark.parametrize("saved,loaded", [(("fsdp", 4), ("fsdp", 2)), (("fsdp", 2), ("fsdp", 4)),
                                          (("ddp", 2), ("fsdp", 4))])
def test_resharded_load_gives_exactly_the_saved_state(saved: tuple[str, int], loaded: tuple[str, int],
                                                       tmp_path: Path) -> None:
    run = written(tmp_path, saved[1], saved[0])
    copy = tmp_path / "copy" / "run"
    shutil.copytree(run, copy)
    got = probe(copy, loaded[1], "--strategy", loaded[0], "--steps", "4", "--reshard")
    assert got["unequal"] == []
    n_model, got_model, n_optim, got_optim = got["counts"]
    assert n_model == got_model > 10 and n_optim == got_optim > 2 * n_model  # every tensor was compared
    # step 4, epoch 0, micro-batch 4: 4 micro-batches of 8/world samples on each rank, the 32 samples consumed
    assert got["position"] == [4, 0, 4]


def rank0_log(run: Path) -> str:
    return "".join(p.read_text() for p in sorted((run / "logs").rglob("rank-0.log")))


@pytest.mark.train
def test_a_resharded_run_trains_on_and_the_refusals_name_the_fixes(tmp_path: Path) -> None:
    run = written(tmp_path, 2, "fsdp")  # to step 4; this test goes on to 6

    def start(*extra: str) -> subprocess.CompletedProcess[str]:
        return hpcjobs("submit", "--profile", "local", "--gpus", "4", "--run-dir", str(run), *ARGS, "--strategy",
                       "fsdp", "--steps", "6", "--extend", *extra, cwd=REPO, timeout=300)

    refused = start()  # at submit, from the checkpoint's meta.json (the ranks refuse it the same way)
    assert refused.returncode == 2, refused.stderr
    assert "written by 2 ranks with --strategy fsdp, this submission has 4 with --strategy fsdp" in refused.stderr
    assert "add --reshard" in refused.stderr
    # --batch-size is per rank: 4 per rank at 4 ranks would be another global batch (16, not 8)
    assert start("--global-batch-size", "0", "--batch-size", "4", "--reshard").returncode != 0
    assert "the global batch would change from 8 to 16" in rank0_log(run) and "--global-batch-size 8" in rank0_log(run)
    out = start("--reshard")
    assert out.returncode == 0, out.stderr[-2000:]
    log = rank0_log(run)
    assert "resumed from" in log and "resharded from 2 ranks" in log
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]  # each step logged once
    meta = json.loads((run / "checkpoints" / "step-6" / "meta.json").read_text())
    assert meta["world_size"] == 4
