"""A bundled task's preset applies before the trainer's flags are judged, at submit and on the node (issue 41, item
5): `--size 7b` is FSDP with activation checkpointing, so the layout flags FSDP takes are valid with it."""

from __future__ import annotations

import pytest
import torch

from conftest import REPO, hpcjobs
from hpcjobs.protocol.settings.trainflags import ConfigError, parse_trainer_args
from hpcjobs.request.taskcheck import check_task_flags, check_trainer_args

ON_7B = [("--replicate-degree", "2"), ("--no-reshard-after-forward",), ("--ac-mode", "selective")]
"""What the FSDP guide recommends for 2 × 8 GPUs with the 7b preset: refused "with --strategy ddp" before."""


@pytest.mark.parametrize("flags", ON_7B, ids=" ".join)
def test_the_7b_preset_applies_before_the_submit_side_judges_its_flags(flags: tuple[str, ...]) -> None:
    args = ("--size", "7b", *flags)
    out = hpcjobs("submit", "--dry-run", "--profile", "testcluster", "--nodes", "2", "--gpus", "8",
                  "trainers.tasks.lm", *args, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "--size 7b (6.45B parameters), fsdp over 16 ranks" in out.stdout, out.stdout
    check_trainer_args(args, 16, "trainers.tasks.lm")
    check_task_flags("trainers.tasks.lm", args, "python3")


@pytest.mark.parametrize("flags", ON_7B, ids=" ".join)
def test_the_7b_preset_applies_before_the_node_judges_its_flags(flags: tuple[str, ...],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from trainers.run import check_task

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # 7b is refused without CUDA, before its flags
    assert check_task("trainers.tasks.lm", ["--size", "7b", *flags]) is None


def test_a_flag_given_still_wins_over_the_preset_and_is_judged_with_it() -> None:
    from hpcjobs.protocol.settings.taskflags import task_defaults
    from hpcjobs.protocol.settings.trainflags import task_args_of

    args = ["--size", "7b", "--strategy", "ddp", "--replicate-degree", "2"]
    with pytest.raises(ConfigError, match=r"^--replicate-degree 2 with --strategy ddp; valid: "):
        parse_trainer_args(args, task_defaults("trainers.tasks.lm", task_args_of(args)))
    assert task_args_of(args) == ["--size", "7b"]
    assert task_defaults("trainers.tasks.lm", ["--size", "huge"]) == {}  # the task's flag check says why
    assert task_defaults("mypkg.mytask", ["--size", "7b"]) == {}  # a user's task: known on the node only
