"""Copy this process's stdout and stderr into a per-rank, per-restart log file, keeping the originals.

A thread pumps a pipe into both places: unlike a `tee` child process it cannot be killed by the preemption signal
that the whole job step receives, and the pipe keeps working in forked DataLoader workers.

Once teed, stdout is a pipe: whether the rank was started on a terminal is recorded first (`was_tty`), and the
original terminal stays reachable (`terminal_stream`, `terminal_hook`) for what belongs there only (the progress bar),
as the log file is for what belongs there only (`log_only`: a failure's traceback).
"""

from __future__ import annotations

import fcntl
import os
import struct
import sys
import termios
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar, TextIO

Hook = Callable[[bytes], None]


class Tee:
    active: ClassVar[Tee | None] = None
    """The Tee of this process, while it is open (the trainer asks it where the terminal is)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "ab", buffering=0)  # append: a restart with the same number never truncates
        self.path = path
        self.was_tty = os.isatty(1)  # before stdout becomes the pipe
        sys.stdout.flush()
        sys.stderr.flush()
        self.saved_out, self.saved_err = os.dup(1), os.dup(2)
        read_end, write_end = os.pipe()
        os.dup2(write_end, 1)
        os.dup2(write_end, 2)
        os.close(write_end)
        self.read_end = read_end
        self.terminal_hook: Hook | None = None
        """When set, what the pump hands the terminal's share to instead of writing it (the progress bar prints
        the lines above itself); the log file always gets them as they came."""
        self._lock = threading.Lock()  # the pump and log_only write the file in whole pieces, never interleaved
        self.thread = threading.Thread(target=self._pump, name="hpcjobs-log-tee", daemon=True)
        self.thread.start()
        Tee.active = self

    def _pump(self) -> None:
        while chunk := os.read(self.read_end, 1 << 16):
            with self._lock:
                self._to_terminal(chunk)
                self.file.write(chunk)

    def _to_terminal(self, chunk: bytes) -> None:
        hook = self.terminal_hook
        try:
            if hook is not None:
                hook(chunk)
                return
        except Exception:  # noqa: BLE001 - a broken progress bar must not take the rank's output with it
            self.terminal_hook = None
        try:
            os.write(self.saved_out, chunk)
        except OSError:
            pass

    def terminal_stream(self) -> TextIO:
        """A text stream onto the original stdout, past the log file (closing it leaves the terminal open)."""
        return open(self.saved_out, "w", buffering=1, closefd=False, encoding="utf-8", errors="replace")

    def log_only(self, text: str) -> None:
        """Write `text` into the log file and nowhere else, after what the rank printed before it."""
        sys.stdout.flush()
        sys.stderr.flush()
        self._drain()
        with self._lock:
            self.file.write(text.encode(errors="replace") + (b"" if text.endswith("\n") else b"\n"))

    def _drain(self, timeout_s: float = 1.0) -> None:
        """Wait (briefly) until the pump has taken everything already written into the pipe."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            waiting = struct.unpack("i", fcntl.ioctl(self.read_end, termios.FIONREAD, b"\0\0\0\0"))[0]
            if not waiting:
                return
            time.sleep(0.005)

    def switch(self, path: Path) -> None:
        """Go on in another log file (a rank that kept its process through a replacement: the new start's log)."""
        sys.stdout.flush()
        sys.stderr.flush()
        self._drain()
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            old, self.file, self.path = self.file, open(path, "ab", buffering=0), path
        old.close()

    def close(self) -> None:
        Tee.active = None
        self.terminal_hook = None
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(self.saved_out, 1)  # the pipe's last write ends close here, so the pump sees EOF
        os.dup2(self.saved_err, 2)
        self.thread.join(timeout=5)
        os.close(self.read_end)
        os.close(self.saved_out)
        os.close(self.saved_err)
        self.file.close()
