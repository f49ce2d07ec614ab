"""A raw DeepSpeed loop (`deepspeed.initialize`) that survives preemption with one line from hpcjobs: the loop's
header, `resumable(...)` (trainers/integrations/deepspeed_loop.py).

    hpcjobs submit --profile local --gpus 2 trainers/examples/deepspeed_script.py --out /tmp/ds   # Ctrl-C, again

A small MLP with dropout on synthetic data made here, shuffled by a DistributedSampler; AdamW and a cosine LR that
DeepSpeed steps at every optimizer step; ZeRO stage 2 or 3 (--zero); gradient accumulation when asked; a loss line
every step (rank 0); work after the loop (the final weights, gathered from the ZeRO-3 partitions; a record; a print)
that runs once per finished training, never on a stop. CPU and gloo as written (deepspeed 0.19.8 picks its CPU
accelerator where no GPU is seen); on GPUs: drop `dist_backend="gloo"` and move the batches to `engine.device`. The
tests run it (tests/test_deepspeed_loop.py).
"""

import argparse
import os
import time

import deepspeed  # type: ignore[import-untyped]
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from trainers.integrations.deepspeed_loop import resumable

p = argparse.ArgumentParser(allow_abbrev=False)
p.add_argument("--out", required=True, help="where the final weights go (final.pt)")
p.add_argument("--zero", type=int, choices=[2, 3], default=2, help="the ZeRO stage")
p.add_argument("--accumulate", type=int, default=1, help="micro-batches a step (gradient_accumulation_steps)")
p.add_argument("--seed", type=int, default=0, help="the model's initial weights, dropout and the sampler's order")
p.add_argument("--sample_seconds", type=float, default=0.0, help="slow data loading: each sample takes this long")
args = p.parse_args()
EPOCHS, SAMPLES = 3, 80  # 10 batches of 4 a rank and epoch at 2 ranks


class Pairs(Dataset):
    """x drawn once (the same on every rank and start), y the sum of its 8 values."""

    def __init__(self) -> None:
        self.x = torch.randn(SAMPLES, 8, generator=torch.Generator().manual_seed(1234))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(args.sample_seconds)
        return self.x[i], self.x[i].sum(0, keepdim=True)


deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(args.seed)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)
config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": args.accumulate,
          "zero_optimization": {"stage": args.zero}, "zero_allow_untested_optimizer": True,
          "steps_per_print": 10**9, "wall_clock_breakdown": False}
engine, opt, _, sched = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=config)
data = Pairs()
loader = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, shuffle=True, seed=args.seed))

for step, (x, y) in resumable(engine, loader, epochs=EPOCHS):
    loss = nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()  # the optimizer and the scheduler at each accumulation's end
    if engine.global_rank == 0:
        print(f"LOSS {step + 1} {loss.item()!r}", flush=True)
        print(f"STEP_END {time.time()!r}", flush=True)  # when the step ended: the script's own step times

with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):  # whole tensors again under ZeRO-3
    weights = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
if engine.global_rank == 0:
    os.makedirs(args.out, exist_ok=True)
    torch.save(weights, os.path.join(args.out, "final.pt"))
    with open(os.path.join(args.out, "after-loop.txt"), "a") as f:
        f.write("ran\n")
    print("AFTER LOOP", flush=True)
torch.distributed.destroy_process_group()
