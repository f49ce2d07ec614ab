"""hpcjobs: submit PyTorch training to Slurm (or this machine) and keep it alive through preemption.

The submit side lives here and never imports torch, so the CLI stays fast on login nodes. The node side
(distributed environment, trainer, checkpoints, preemption) lives in the `trainers` package.
"""

__version__ = "0.1.0"
