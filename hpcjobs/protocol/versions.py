"""The oldest torch the node side runs on, and the job script's check of it. Both sides need the floor (the submit
side renders the check and names the floor in its errors; every rank checks it at start, trainers.versions);
`pyproject.toml` declares the same floor, and a test keeps the two equal."""

from __future__ import annotations

TORCH_FLOOR = (2, 7)
"""torch.utils.serialization.config (checkpoint writes without the zip CRC) is the newest API the node side needs;
torch 2.6 has none (measured: a 2.6 run failed at its first save). 2.7.1, 2.11 (an H100) and 2.13 run the tests."""

FLOOR_TEXT = ".".join(map(str, TORCH_FLOOR))

CHECK = ("import sys; from trainers.versions import torch_problem; problem = torch_problem(); "
         "problem and sys.exit(problem)")
"""Python statements that exit 1 with a short reason when torch is missing or too old, else go on (the job script's
check, followed by the imports it needs). They name the node side's module as text, never by import."""
