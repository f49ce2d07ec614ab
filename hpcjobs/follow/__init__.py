"""Submitted jobs followed: what the scheduler says of a job, then what its run folder says, as status shows it."""
