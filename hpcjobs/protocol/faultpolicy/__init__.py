"""Fault policy both sides apply: kinds of failure, which rank failed first and why, whether a job recovers by
itself, the restart cap, srun's words."""
