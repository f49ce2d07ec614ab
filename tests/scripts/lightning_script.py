"""An unchanged Lightning script, as users write them: a small MLP with dropout, synthetic data made here, SGD with
momentum and an epoch LR schedule (or AdamW and a cosine schedule stepped every step), a loss line every step (rank 0),
DDP over the ranks hpcjobs started, and work after `fit()` (the final weights, a record and a print) that must run once
per finished training, never on a stop."""

import argparse
import os
import time

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--max_epochs", type=int, default=3)
p.add_argument("--devices", type=int, default=2)
p.add_argument("--num_nodes", type=int, default=1)
p.add_argument("--sample_seconds", type=float, default=0.0, help="slow data loading: each sample takes this long")
p.add_argument("--samples", type=int, default=80,
               help="the dataset's length (80: 10 batches a rank and epoch at 2 ranks)")
p.add_argument("--seed", type=int, default=0)
p.add_argument("--adamw", action="store_true", help="AdamW and a cosine LR stepped every step (not SGD, by epoch)")
args = p.parse_args()


class Samples(Dataset):
    def __len__(self) -> int:
        return args.samples

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(args.sample_seconds)
        x = torch.randn(8, generator=torch.Generator().manual_seed(i))
        return x, x.sum(0, keepdim=True)


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        if self.global_rank == 0:
            print(f"LOSS {self.global_step + 1} {loss.item()!r}", flush=True)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self.global_rank == 0:  # the script's own clock: when each step ended, as users log their step times
            print(f"STEP_END {time.time()!r}", flush=True)

    def configure_optimizers(self):
        if args.adamw:
            opt = torch.optim.AdamW(self.parameters(), lr=0.01)
            cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)
            return [opt], [{"scheduler": cosine, "interval": "step"}]
        opt = torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Samples(), batch_size=4, shuffle=True)


torch.manual_seed(args.seed)
model = Net()
trainer = pl.Trainer(accelerator="cpu", devices=args.devices, num_nodes=args.num_nodes, max_epochs=args.max_epochs,
                     strategy="ddp" if args.devices * args.num_nodes > 1 else "auto", log_every_n_steps=1,
                     enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                     default_root_dir=args.out)
trainer.fit(model)
if trainer.is_global_zero:
    torch.save(model.state_dict(), os.path.join(args.out, "final.pt"))
    with open(os.path.join(args.out, "after-fit.txt"), "a") as f:
        f.write("ran\n")
    print("AFTER FIT", flush=True)
