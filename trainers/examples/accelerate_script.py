"""An accelerate loop that survives preemption with one line from hpcjobs: the loop's header, `resumable(...)`.

    hpcjobs submit --profile mycluster --nodes 2 --gpus 8 trainers/examples/accelerate_script.py --out runs/acc
    hpcjobs submit --profile local --gpus 2 trainers/examples/accelerate_script.py --out /tmp/acc   # Ctrl-C, again

A small MLP with dropout on synthetic data made here, shuffled; SGD with momentum and an epoch LR schedule (or, with
--adamw, AdamW and a cosine LR stepped every step); gradient
accumulation when asked; a loss line every step (rank 0); work after the loop (the final weights, a record, a print)
that runs once per finished training, never on a stop. The tests run it (tests/test_accelerate_loop.py). On GPUs:
`Accelerator()` instead of `Accelerator(cpu=True)`.
"""

import argparse
import os
import time

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn
from torch.utils.data import DataLoader, Dataset

from trainers.integrations.accelerate_loop import resumable

p = argparse.ArgumentParser(allow_abbrev=False)
p.add_argument("--out", required=True)
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--save_every", type=int, default=0)
p.add_argument("--accumulate", type=int, default=1)
p.add_argument("--samples", type=int, default=80,
               help="the dataset's length (80: 10 batches a rank and epoch at 2 ranks)")
p.add_argument("--seed", type=int, default=0)
p.add_argument("--adamw", action="store_true", help="AdamW and a cosine LR stepped every step (not SGD, by epoch)")
p.add_argument("--sample_seconds", type=float, default=0.0, help="slow data loading: each sample takes this long")
args = p.parse_args()


class Samples(Dataset):
    def __len__(self) -> int:
        return args.samples

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(args.sample_seconds)
        x = torch.randn(8, generator=torch.Generator().manual_seed(i))
        return x, x.sum(0, keepdim=True)


accelerator = Accelerator(cpu=True, gradient_accumulation_steps=args.accumulate)
set_seed(args.seed)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))
opt: torch.optim.Optimizer
sched: torch.optim.lr_scheduler.LRScheduler
if args.adamw:
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)
else:
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
model, opt, loader, sched = accelerator.prepare(model, opt, DataLoader(Samples(), batch_size=4, shuffle=True), sched)

for step, (x, y) in resumable(accelerator, loader, epochs=args.epochs, save_every=args.save_every,
                              epoch_end=lambda epoch: None if args.adamw else sched.step()):
    with accelerator.accumulate(model):
        loss = nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        opt.step()
        if args.adamw:
            sched.step()
        opt.zero_grad()
    if accelerator.is_main_process:
        print(f"LOSS {step + 1} {loss.item()!r}", flush=True)
        print(f"STEP_END {time.time()!r}", flush=True)  # when the step ended: the script's own step times

accelerator.wait_for_everyone()
if accelerator.is_main_process:
    os.makedirs(args.out, exist_ok=True)
    torch.save(accelerator.unwrap_model(model).state_dict(), os.path.join(args.out, "final.pt"))
    with open(os.path.join(args.out, "after-loop.txt"), "a") as f:
        f.write("ran\n")
    print("AFTER LOOP", flush=True)
accelerator.end_training()
