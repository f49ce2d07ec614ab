"""An unchanged Hugging Face Trainer script, as users write them: a tiny GPT-2 built from its config, token ids made
here (no hub), a log line every step, the usual `get_last_checkpoint` resume, and work after `train()` (save_model,
a record and a print) that must run once per finished training, never on a stop."""

import argparse
import os
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

p = argparse.ArgumentParser()
p.add_argument("--output_dir", required=True)
p.add_argument("--max_steps", type=int, default=40)
p.add_argument("--save_steps", type=int, default=10)
p.add_argument("--resume_from_checkpoint", default=None)
p.add_argument("--sample_seconds", type=float, default=0.0, help="slow data loading: each sample takes this long")
p.add_argument("--seed", type=int, default=0)
p.add_argument("--deepspeed", default=None, help="a DeepSpeed config (JSON): ZeRO through the Trainer's deepspeed=")
p.add_argument("--ddp_find_unused_parameters", choices=["true", "false"], default=None,
               help="false: DDP rebuilds its buckets after the first step (the Trainer's own default for a model with "
                    "activation checkpointing); default: the Trainer's choice")
args = p.parse_args()


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4096

    def __getitem__(self, i: int) -> dict:
        time.sleep(args.sample_seconds)
        ids = torch.randint(0, 128, (32,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


class StepClock(TrainerCallback):
    """The script's own clock: when each step ended (rank 0), as users log their step times."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            print(f"STEP_END {time.time()!r}", flush=True)


torch.manual_seed(args.seed)
model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2))
training_args = TrainingArguments(
    output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=4, logging_steps=1,
    save_steps=args.save_steps, report_to=[], use_cpu=True, ddp_backend="gloo", disable_tqdm=True, seed=args.seed,
    dataloader_num_workers=0, deepspeed=args.deepspeed,
    ddp_find_unused_parameters={"true": True, "false": False}.get(args.ddp_find_unused_parameters))
trainer = Trainer(model=model, args=training_args, train_dataset=Tokens(), callbacks=[StepClock()])
last = args.resume_from_checkpoint
if last is None and os.path.isdir(args.output_dir):
    last = get_last_checkpoint(args.output_dir)
trainer.train(resume_from_checkpoint=last)
trainer.save_model(os.path.join(args.output_dir, "final"))
if trainer.is_world_process_zero():
    with open(os.path.join(args.output_dir, "after-train.txt"), "a") as f:
        f.write("ran\n")
    print("AFTER TRAIN", flush=True)
