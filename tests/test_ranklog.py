"""trainers.ranklog: the node's one logger. Its lines keep the wording and stream the prints had (stdout for `say`,
stderr for `warn`), found where pytest's capsys or an fd swap put the streams after import; rank 0 speaks unless a
line is for every rank, the others' lines go to their log file only; nothing reaches a user's root handlers."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainers import ranklog

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _no_sink() -> object:
    yield
    ranklog.log_only_to(None)


def test_streams_and_wording(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    ranklog.say("hpcjobs: to stdout 100%")
    ranklog.warn("hpcjobs: to stderr")
    out = capsys.readouterr()
    assert (out.out, out.err) == ("hpcjobs: to stdout 100%\n", "hpcjobs: to stderr\n")


def test_rank_filter(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    kept: list[str] = []
    ranklog.say("not rank 0's")
    ranklog.log_only_to(kept.append)
    ranklog.warn("rank 1's refusal")
    ranklog.say("every rank's", every_rank=True)
    ranklog.warn("rank 0 says so", rank=0)
    out = capsys.readouterr()
    assert (out.out, out.err) == ("every rank's\n", "rank 0 says so\n")
    assert kept == ["rank 1's refusal"]


def test_no_propagation(capsys: pytest.CaptureFixture[str]) -> None:
    """A user's root handler never gets the node's lines (pytest 9's own capture handlers are put on every logger,
    so the test uses a handler of its own)."""
    got: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            got.append(record)

    handler = Keep()
    logging.getLogger().addHandler(handler)
    try:
        ranklog.say("hpcjobs: only once", every_rank=True)
    finally:
        logging.getLogger().removeHandler(handler)
    assert got == [] and capsys.readouterr().out == "hpcjobs: only once\n"
    assert logging.getLogger(ranklog.NAME).propagate is False


def test_fd_swap_after_import(tmp_path: Path) -> None:
    """The launcher's Tee swaps fds 1 and 2 after this module is imported: the lines follow into its log file."""
    code = ("import logging; logging.basicConfig(format='ROOT %(message)s')\n"
            "from pathlib import Path; from trainers import ranklog; from trainers.logtee import Tee\n"
            f"tee = Tee(Path({str(tmp_path / 'rank-0.log')!r}))\n"
            "ranklog.say('hpcjobs: out'); ranklog.warn('hpcjobs: err'); tee.close()\n")
    env = {k: v for k, v in os.environ.items() if k != "RANK"}
    got = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert got.returncode == 0, got.stderr
    assert (tmp_path / "rank-0.log").read_text() == "hpcjobs: out\nhpcjobs: err\n"
    assert "ROOT" not in got.stdout + got.stderr
