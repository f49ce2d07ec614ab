"""The scheduler backends: the only place in hpcjobs that knows which scheduler runs a job.

Each backend (`slurm`, `local`) implements the `Backend` protocol in the spirit of torchx's Scheduler:
`dry_run(spec) -> request` (pure: the request's `text` is what would be submitted), `submit(request) -> job id`
(the one side effect), `state`, `cancel`, `logs`. Everything else in the package asks `backend_for(...)`.
"""

from __future__ import annotations

SCHEDULERS = ("slurm", "local")
"""The `scheduler` values a profile may name, one backend module each under hpcjobs/backends/."""
