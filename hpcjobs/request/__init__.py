"""Building one job request from the command line: the frozen spec, the entry it runs, sweeps and chains,
the code snapshot, the ranks' settings, and the checks made before anything is queued (flags, memory, resume)."""
