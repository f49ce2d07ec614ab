"""The variables that give a rank its identity and rendezvous, set by whoever started it (the launcher, torchrun) and
read by the node (trainers.distenv): a new job never inherits them (hpcjobs.backends.start_env), and a profile's `env:`
may not set them (hpcjobs.profiles.cluster_profile). Imports nothing."""

from __future__ import annotations

RENDEZVOUS = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT", "HPCJOBS_JOB_ID", "HPCJOBS_RESTART", "HPCJOBS_CONTRACT")
"""A rank's identity and rendezvous, set by whoever started it (the launcher, torchrun): never inherited."""
