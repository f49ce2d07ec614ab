"""Run a task with the shared trainer on this rank: parse the trainer's flags, load the task, join the group."""

from __future__ import annotations

import argparse

from hpcjobs.runfolder import RunFolder
from trainers import config
from trainers.dist import distributed
from trainers.task import load_task
from trainers.trainer import train


def parse_config(task_ref: str, args: list[str], defaults: dict[str, object] | None = None,
                 ) -> tuple[config.TrainConfig, list[str]]:
    p = argparse.ArgumentParser(prog=f"trainer for {task_ref}", add_help=True)
    config.add_arguments(p, defaults)
    ns, rest = p.parse_known_args(args)
    return config.from_namespace(ns), rest


def run_task(task_ref: str, args: list[str], run: RunFolder) -> int:
    _, task_args = parse_config(task_ref, args)
    task = load_task(task_ref, task_args)
    cfg, _ = parse_config(task_ref, args, task.defaults)
    with distributed() as ctx:
        return train(task, cfg, run, ctx)
