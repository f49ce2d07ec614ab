"""A checkpoint that does not fit (a full disk or quota): the save fails with one line naming the folder and the
bytes, the unfinished folder is removed, the previous checkpoint stays intact and loadable. Run on a real small
filesystem (a 2 MiB tmpfs in a private mount namespace); the real-cluster version is in
tests/cluster/test_faults_cluster.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = r'''
import sys, torch
from pathlib import Path
from trainers import checkpoint
root = Path(sys.argv[1]) / "checkpoints"
state = {"model": {"w": torch.arange(300_000, dtype=torch.float32)}}  # 1.2 MB: one fits in 2 MiB, two do not
checkpoint.save_checkpoint(root, 1, state, {"rng": 1})
try:
    checkpoint.save_checkpoint(root, 2, state, {"rng": 2})
except checkpoint.CheckpointSpaceError as e:
    print("ERROR", e)
print("LEFT", sorted(p.name for p in root.iterdir()))
ref = checkpoint.latest(root)
print("LATEST", ref.step, bool(torch.equal(checkpoint.load_checkpoint(ref, 0)[0]["model"]["w"], state["model"]["w"])))
'''


NEEDS_UNSHARE = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                   reason="needs root and unshare (CI has both)")


def on_small_disk(tmp_path: Path, size: str, script: str) -> tuple[Path, dict[str, str]]:
    """Run `script` with a fresh tmpfs of `size` as its argv[1] (a private mount namespace); (that folder, its
    printed `KEY value` lines), after checking that it exited 0."""
    disk = tmp_path / "small"
    disk.mkdir()
    mount = f'mount -t tmpfs -o size={size} tmpfs "$1" && exec "$2" -c "$3" "$1"'
    out = subprocess.run(["unshare", "-m", "sh", "-c", mount, "sh", str(disk), sys.executable, script],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return disk, dict(line.split(" ", 1) for line in out.stdout.splitlines())


@NEEDS_UNSHARE
def test_a_checkpoint_that_does_not_fit_leaves_the_previous_one_intact(tmp_path: Path) -> None:
    disk, lines = on_small_disk(tmp_path, "2M", SCRIPT)
    assert lines["ERROR"].startswith(f"checkpoint step-2 does not fit in {disk}/checkpoints: No space left on device ")
    assert "bytes free; a checkpoint of this run takes 1,2" in lines["ERROR"] and "step-1 is intact" in lines["ERROR"]
    assert "HINT: free space there" in lines["ERROR"] and "\n" not in lines["ERROR"]
    assert lines["LEFT"] == "['step-1']"  # the unfinished .step-2.tmp is gone: its space is given back
    assert lines["LATEST"] == "1 True"


SHARDED = r'''
import sys, time, torch
from pathlib import Path
from trainers import checkpoint
from trainers.checkpoint.sharded import Checkpointer
from trainers.checkpoint.dcp_files import model_weights
from trainers.checkpoint.stateful import ModelState, OptimizerState
from trainers.dist import DistContext
from trainers.distenv import DistEnv
root = Path(sys.argv[1]) / "checkpoints"
env = DistEnv(0, 0, 1, 1, "127.0.0.1", 1, "0", 0, "single")
if GROUP:  # DCP then pickles each rank's error to gather it, as on a real multi-rank run
    import torch.distributed as dist
    from hpcjobs.protocol.ports import free_port
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
model = torch.nn.Linear(300, 1000)  # 1.2 MB of weights, 3.6 MB with AdamW's moments: one fits in 6 MiB, two do not
opt = torch.optim.AdamW(model.parameters())
model(torch.ones(1, 300)).sum().backward()
opt.step()
states = {"model": ModelState(model), "optimizer": OptimizerState(model, opt)}
ckpt = Checkpointer(root, DistContext(env, torch.device("cpu"), "gloo"), keep=2, states=states)
ckpt.save(1, {}, background=False)
ckpt.save(2, {}, background=True)
try:
    for _ in range(600):  # the trainer's steps: each asks whether the save in flight failed
        ckpt.before_update()
        ckpt.check()
        time.sleep(0.01)
except checkpoint.CheckpointSpaceError as e:
    print("ERROR", e)
print("LEFT", sorted(p.name for p in root.iterdir()))
ref = checkpoint.latest(root)
print("LATEST", ref.step, bool(torch.equal(model_weights(ref)["weight"], model.weight.detach())))
'''


@pytest.mark.train
@NEEDS_UNSHARE
@pytest.mark.parametrize("group", [False, True], ids=["no-group", "process-group"])
def test_a_background_save_that_does_not_fit_is_raised_at_the_next_step(tmp_path: Path, group: bool) -> None:
    """The trainer's sharded, asynchronous save: the full disk is raised on the training thread at the next step
    (not one interval later), with the same one line, the unfinished folder removed, the previous one loadable.
    With a process group, DCP gathers the error through pickle, which drops what torch.save's error wraps."""
    disk, lines = on_small_disk(tmp_path, "6M", SHARDED.replace("GROUP", str(group)))
    assert lines["ERROR"].startswith(f"checkpoint step-2 does not fit in {disk}/checkpoints: No space left on device ")
    assert "step-1 is intact" in lines["ERROR"] and "\n" not in lines["ERROR"]
    assert lines["LEFT"] == "['step-1']"
    assert lines["LATEST"] == "1 True"
