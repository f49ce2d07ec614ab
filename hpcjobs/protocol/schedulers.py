"""The schedulers hpcjobs speaks, both sides' list in one place: a new scheduler is a module on each side
(hpcjobs/backends/NAME/NAME.py, trainers/jobenv/NAME.py) and its name here. Imports nothing."""

from __future__ import annotations

SCHEDULERS = ("slurm", "local")
"""The `scheduler` values a profile may name: one package each, hpcjobs/backends/<name>/, whose <name>.py defines
BACKEND."""

JOB_ENVIRONMENTS = ("slurm", "torchrun", "single")
"""What started a rank, in the order a rank asks (trainers.jobenv.current): one module each, trainers/jobenv/<name>.py,
with `applies(env)` and its JobEnv class as ENVIRONMENT. A scheduler comes before torchrun (a launcher inside a job
is still that scheduler's job); `single` (no scheduler) applies always and comes last."""
