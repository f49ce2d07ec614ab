"""The local backend: every rank a process on this machine, without Slurm."""
