"""A user's own DDP script (torchrun style) that survives preemption with two helpers from `trainers`.

    hpcjobs submit --profile mycluster --nodes 2 --gpus 8 trainers/examples/own_script.py --steps 2000
    torchrun --nproc_per_node 2 trainers/examples/own_script.py --steps 200 --run-dir runs/own
"""

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hpcjobs.protocol.contract import LaunchContract
from trainers.checkpoint import latest, load_checkpoint, save_checkpoint
from trainers.preemption import StopGuard

launched = LaunchContract.current()  # under hpcjobs: the job's run folder (resolved), signal and restart cap
p = argparse.ArgumentParser(allow_abbrev=False)
p.add_argument("--steps", type=int, default=500)
p.add_argument("--run-dir", default=launched.run_dir if launched else "runs/own-script")
args = p.parse_args()

# hpcjobs set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT. On GPUs: torch.cuda.set_device(int(os.environ[
# "LOCAL_RANK"])) first, then "nccl", the model and its inputs .cuda(), and DDP(model, device_ids=[that index]).
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
ckpts = Path(args.run_dir) / "checkpoints"

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
step = 0
if (ref := latest(ckpts)) is not None:  # resume from the newest finished checkpoint, if any
    state, _ = load_checkpoint(ref, rank)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    step = state["step"]
    print(f"rank {rank}: resumed from {ref.path}", flush=True)
ddp = nn.parallel.DistributedDataParallel(model)
# DDP regroups its gradient buckets after the first backward, which changes gloo's summation order: one throwaway
# backward makes a fresh and a resumed run reduce every real step the same way (bit-identical weights).
F.mse_loss(ddp(torch.zeros(1, 32)), torch.zeros(1, 1)).backward()
opt.zero_grad()
guard = StopGuard()  # the profile's signal and SIGTERM only set a flag


def save(step: int) -> None:
    save_checkpoint(ckpts, step, {"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, {},
                    rank=rank, world_size=world, barrier=dist.barrier)


while step < args.steps:
    g = torch.Generator().manual_seed(step * world + rank)  # the data of a step depends on the step alone
    x = torch.randn(64, 32, generator=g)
    loss = F.mse_loss(ddp(x), x.sum(1, keepdim=True))
    opt.zero_grad()
    loss.backward()
    opt.step()
    step += 1
    if step % 100 == 0 and rank == 0:
        print(f"step {step} loss {loss.item():.4f}", flush=True)
    if guard.should_stop():  # all ranks agree at the same step
        save(step)
        guard.requeue_and_exit(step)  # rank 0 requeues the job; every rank exits

save(step)
print(f"rank {rank}: done at step {step}", flush=True)
dist.destroy_process_group()
