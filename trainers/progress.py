"""What rank 0 shows a person at a terminal: a progress bar (elapsed, ETA) while training, one summary line at the end.

The bar goes to the original terminal only, never into the rank's log file: the launcher's Tee has made stdout a
pipe, so whether the rank was started on a terminal comes from the Tee (`was_tty`), and the bar draws on the stream
the Tee kept. While the bar is up, the rank's own output reaches the terminal through it (printed above the bar, whole
lines), so log lines and the bar never garble each other; the log file gets the output as before.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Protocol, TextIO

from hpcjobs.protocol.runfolder import RunFolder


class Terminal(Protocol):
    """The part of trainers.logtee.Tee the bar uses (tests pass a stand-in)."""

    was_tty: bool
    terminal_hook: Any

    def terminal_stream(self) -> TextIO: ...


class Bar:
    def __init__(self, terminal: Terminal, total: int, done: int, force_terminal: bool | None = None) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.terminal = terminal
        self.stream = terminal.terminal_stream()
        self.console = Console(file=self.stream, force_terminal=force_terminal, highlight=False)
        self.progress = Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(), TextColumn("steps"),
                                 TextColumn("elapsed"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                                 console=self.console, transient=True, redirect_stdout=False, redirect_stderr=False)
        self.task_id = self.progress.add_task("training", total=total, completed=done)
        self._partial = b""
        self.progress.start()
        terminal.terminal_hook = self.write

    def update(self, step: int) -> None:
        self.progress.update(self.task_id, completed=step)

    def write(self, chunk: bytes) -> None:
        """The rank's output on its way to the terminal (the Tee's pump thread): whole lines, above the bar."""
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        if lines:
            self.console.out(b"\n".join(lines).decode(errors="replace"), highlight=False)

    def close(self) -> None:
        self.terminal.terminal_hook = None
        self.progress.stop()
        if self._partial:
            self.console.out(self._partial.decode(errors="replace"), end="", highlight=False)
            self._partial = b""
        self.stream.flush()


def human_time(seconds: float) -> str:
    s = int(round(seconds))
    if s < 60:
        return f"{seconds:.1f} s"
    h, rest = divmod(s, 3600)
    return f"{h}h{rest // 60:02d}m{rest % 60:02d}s" if h else f"{rest // 60}m{rest % 60:02d}s"


def summary(run: RunFolder, step: int, first_step: int, elapsed_s: float) -> str:
    """One line for the end of training: elapsed, steps, last and best loss (best val_loss when evaluated), and
    where the checkpoints and metrics are. Read back from metrics.jsonl, so a resumed run reports the whole run."""
    records = _records(run.metrics)
    losses = [(r["step"], r["loss"]) for r in records if _finite(r.get("loss"))]
    evals = [(r["step"], r["val_loss"]) for r in records if _finite(r.get("val_loss"))]
    trained = f"{step - first_step} steps this start" if step > first_step else "nothing left to train"
    parts = [f"finished at step {step} in {human_time(elapsed_s)} ({trained})"]
    if losses:
        parts.append(f"last loss {losses[-1][1]:.4f}")
    if evals:
        at, best = min(evals, key=lambda e: e[1])
        parts.append(f"best val_loss {best:.4f} (step {at})")
    elif losses:
        at, best = min(losses, key=lambda e: e[1])
        parts.append(f"best loss {best:.4f} (step {at})")
    return " | ".join(parts) + f" | checkpoints in {run.checkpoints}, metrics in {run.metrics}"


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _records(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            out.append(rec)
    return out
