"""trainers.ranklog.rank0, the shared trainer's `[hpcjobs rank 0] ...` lines (its log, the meter's step and val_loss
lines, the local tier's resume line): rank 0 says them on stdout, as the prints did; another rank says nothing, not
even to its log file (the prefix names rank 0)."""

from __future__ import annotations

import pytest

from trainers import ranklog


def test_rank_0_says_it_on_stdout_and_another_rank_nowhere(capsys: pytest.CaptureFixture[str]) -> None:
    kept: list[str] = []
    ranklog.log_only_to(kept.append)
    try:
        ranklog.rank0("step 20 | loss 1.0000", 0)
        ranklog.rank0("step 20 | loss 1.0000", 1)
    finally:
        ranklog.log_only_to(None)
    out = capsys.readouterr()
    assert (out.out, out.err, kept) == ("[hpcjobs rank 0] step 20 | loss 1.0000\n", "", [])
