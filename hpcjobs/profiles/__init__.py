"""Cluster profiles: the YAML a user writes, its schema and reference table, containers and Slurm's notations."""
