"""The rank's timeouts a user may set, each as (environment variable, default seconds): read by every rank
(trainers.distenv.setting_seconds) and compared with Slurm's settings by `hpcjobs doctor`."""

INIT_TIMEOUT = ("HPCJOBS_INIT_TIMEOUT", 300.0)
"""Seconds every rank waits for the others at start-up: the rendezvous and every collective until the first step
has finished (a cold node's imports, the first compile, loading a checkpoint)."""

COLLECTIVE_TIMEOUT = ("HPCJOBS_COLLECTIVE_TIMEOUT", 120.0)
"""Seconds a training collective may wait once the first step has finished: a rank that hangs (a dead GPU, a
deadlock) ends the job this soon instead of after the start-up allowance. Checkpoint barriers and the stop agreement
keep the start-up allowance (rank 0 may write for minutes). The hang watchdog (trainers/watchdog.py) usually ends a
hang far sooner: its bound is learned from the measured step times."""

STALL = ("HPCJOBS_STALL_S", 10.0)
"""A pause without step progress the user declares normal for the job (a data loader that refills a shuffle buffer
for minutes, an evaluation of its own that reports nothing): the hang watchdog's bound is never shorter
(trainers/hangbound.py). Unset: the profile's `recovery.hang_min_s` alone is the floor (the default here is only
what a malformed value's hint suggests)."""
