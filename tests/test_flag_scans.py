"""The trainer's flags are scanned once per side (issue 36, item 6): `hpcjobs submit` checked a sweep point's flags
in check_trainer_args, check_task_flags, the memory fit, the dry-run's plan line and the stop-checkpoint window line,
each scanning the argv again (measured on the code before: 20 scans for a two-point sweep's `submit --dry-run`, 10 a
point); now every caller goes through one lru_cache'd scan over the argv tuple
(hpcjobs.protocol.settings.trainflags.scan_flags), so each distinct argv is scanned once."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO
from hpcjobs.cli import main
from hpcjobs.protocol.settings import trainflags

PROFILE = ("scheduler: slurm\ngpus_per_node: 8\ngpu_memory: 80GB\nmax_nodes: 64\npreemption:\n  seconds_before: 120\n"
           "storage:\n  write_gb_per_s: 0.5\n")


def counted(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, ...]]:
    """Each argv the uncached scan reads, in order (the cache emptied first: another test may have filled it)."""
    seen: list[tuple[str, ...]] = []
    scan: Callable[..., Any] = trainflags._scan

    def counting(args: list[str], *rest: Any) -> Any:
        seen.append(tuple(args))
        return scan(args, *rest)

    monkeypatch.setattr(trainflags, "_scan", counting)
    cache_clear = getattr(getattr(trainflags, "scan_flags", None), "cache_clear", None)
    if cache_clear is not None:
        cache_clear()
    return seen


def test_a_sweep_submit_scans_each_points_flags_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    profile = tmp_path / "cluster.yaml"
    profile.write_text(PROFILE)
    monkeypatch.chdir(REPO)
    seen = counted(monkeypatch)
    code = main(["submit", "--profile", str(profile), "--nodes", "2", "--gpus", "8", "--dry-run", "--no-snapshot",
                 "--run-dir", str(tmp_path / "runs" / "s-%a"), "--sweep", "lr=1e-3,3e-4",
                 "trainers.tasks.lm", "--size", "7b", "--steps", "100"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "stop checkpoint" in err  # the window line's plan was made too
    assert len(seen) == len(set(seen)), f"{len(seen)} scans of {len(set(seen))} argvs: {seen}"


def test_the_cached_scan_gives_what_the_parser_gave() -> None:
    args = ["--steps", "7", "--size", "tiny", "--lr=0.5", "--steps", "9", "--", "--steps", "1"]
    trainflags.scan_flags.cache_clear()
    cfg, rest = trainflags.parse_trainer_args(args, {"batch_size": 4})
    assert (cfg.steps, cfg.lr, cfg.batch_size) == (9, 0.5, 4) and rest == ["--size", "tiny", "--", "--steps", "1"]
    rest.append("x")  # a caller's list is its own: the cached scan is not changed by it
    assert trainflags.task_args_of(args) == ["--size", "tiny", "--", "--steps", "1"]
    assert trainflags.scan_flags.cache_info().hits == 1
    with pytest.raises(trainflags.ConfigError, match="--steps 'x' is not a whole number"):
        trainflags.parse_trainer_args(["--steps", "x"])
