"""The Slurm backend: submission through submitit, renderers of sbatch text, doctor's checks, the probe, faults."""
