"""What a rank asks of the scheduler that started it, one module per scheduler (the node side's counterpart of
hpcjobs/backends/): today `slurm` (why a SIGTERM came, when the job ends, requeue). Torch-free."""
