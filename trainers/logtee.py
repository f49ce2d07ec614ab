"""Copy this process's stdout and stderr into a per-rank, per-restart log file, keeping the originals.

A thread pumps a pipe into both places: unlike a `tee` child process it cannot be killed by the preemption signal
that the whole job step receives, and the pipe keeps working in forked DataLoader workers.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path


class Tee:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "ab", buffering=0)  # append: a restart with the same number never truncates
        sys.stdout.flush()
        sys.stderr.flush()
        self.saved_out, self.saved_err = os.dup(1), os.dup(2)
        read_end, write_end = os.pipe()
        os.dup2(write_end, 1)
        os.dup2(write_end, 2)
        os.close(write_end)
        self.read_end = read_end
        self.thread = threading.Thread(target=self._pump, name="hpcjobs-log-tee", daemon=True)
        self.thread.start()

    def _pump(self) -> None:
        while chunk := os.read(self.read_end, 1 << 16):
            try:
                os.write(self.saved_out, chunk)
            except OSError:
                pass
            self.file.write(chunk)

    def close(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(self.saved_out, 1)  # the pipe's last write ends close here, so the pump sees EOF
        os.dup2(self.saved_err, 2)
        self.thread.join(timeout=5)
        os.close(self.read_end)
        os.close(self.saved_out)
        os.close(self.saved_err)
        self.file.close()
