"""A rank that logs to Weights & Biases offline with the key its shell had (tests/test_secrets.py): every rank prints
the sha256 of WANDB_API_KEY, and rank 0 runs a wandb run into the run folder, as a training script does, so a test
can search what the tracker wrote for the key."""

import hashlib
import os

import wandb

value = os.environ.get("WANDB_API_KEY")
digest = hashlib.sha256(value.encode()).hexdigest() if value is not None else "missing"
print(f"rank {os.environ.get('RANK')} WANDB_API_KEY sha256 {digest}", flush=True)
if os.environ.get("RANK") == "0":
    run = wandb.init(project="canary", mode="offline", dir=os.environ["HPCJOBS_RUN_DIR"])
    for step in range(3):
        run.log({"loss": 1.0 / (step + 1)}, step=step)
    run.finish()
