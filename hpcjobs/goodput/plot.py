"""The pictures `hpcjobs compare --plot` and `hpcjobs goodput --plot` draw, and the checks both run first: the format
from the file's suffix and matplotlib's presence, each checked before any run folder is read (a wrong name must not
cost a sweep's worth of reading), and the atomic write (a viewer sees the old picture or the new one).

Split from compare.py (349 lines, at the size cap's edge) so the table and the plot each have headroom. Torch-free;
matplotlib is imported only inside the functions that draw.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcjobs.protocol.atomic import replacing
from hpcjobs.protocol.errors import RuntimeFailure, UsageError
from hpcjobs.protocol.paths import refuse_output

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from hpcjobs.goodput.compare import Row

PLOT_FORMATS = {".png": "png", ".pdf": "pdf", ".svg": "svg"}
PLOT_HINT = ("pip install matplotlib into the Python that runs hpcjobs (it is the plot extra: `pip install '.[plot]'` "
             "from a clone of hpcjobs).")


def plot_format(out_path: str | os.PathLike[str], force: bool = False) -> str:
    """Checked before anything is read: a wrong name must not cost a sweep's worth of reading first, and an
    existing file is kept unless forced."""
    path = Path(out_path)
    fmt = PLOT_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise UsageError(f"--plot {out_path}: cannot tell the format from {path.suffix or 'a name with no suffix'!r}; "
                         f"valid: {', '.join(PLOT_FORMATS)}.", "e.g. --plot loss.png")
    refuse_output(path, force, "--plot", "loss.png")
    if not path.parent.is_dir():
        raise UsageError(f"--plot {out_path}: the folder {path.parent} does not exist.",
                         "create it first, or write the plot elsewhere.")
    return fmt


def require_matplotlib() -> None:
    """matplotlib is an optional extra: say how to get it in one line, before any work is done."""
    try:
        import matplotlib.figure  # noqa: F401
    except ImportError:
        raise UsageError(f"--plot needs matplotlib, which this Python ({sys.executable}) does not have.",
                         PLOT_HINT) from None


def log_scale(rows: Sequence[Row]) -> bool:
    """Curves spanning more than 10× are flat lines on a linear axis once the first steps' loss sets its top."""
    values = [v for r in rows for _, v in (*r.loss_curve, *r.val_curve) if math.isfinite(v)]
    return bool(values) and min(values) > 0 and max(values) / min(values) > 10


def plot(rows: Sequence[Row], out_path: str | os.PathLike[str], force: bool = False) -> Path:
    """One curve per run (x = step, y = loss; val_loss dashed in the same colour), written atomically: a reader
    (an image viewer, a notebook) sees the old picture or the new one, never half a file."""
    fmt = plot_format(out_path, force)
    require_matplotlib()
    from matplotlib.figure import Figure
    from matplotlib.ticker import LogFormatter, MaxNLocator

    with_goodput = any(r.goodput_s for r in rows)
    fig = Figure(figsize=(8, 5 + 0.3 * len(rows) * with_goodput), layout="constrained")
    ax, *below = fig.subplots(2, 1, height_ratios=[3, 1]) if with_goodput else [fig.add_subplot()]
    if below:
        goodput_bars(below[0], rows)
    drawn = 0
    for i, r in enumerate(rows):
        color = f"C{i % 10}"
        for curve, style, suffix in ((r.loss_curve, "-", ""), (r.val_curve, "--", " (val_loss)")):
            points = [(s, v) for s, v in curve if math.isfinite(v)]
            if points:
                ax.plot([s for s, _ in points], [v for _, v in points], style, color=color, label=r.label + suffix,
                        marker="o" if len(points) == 1 else None)  # one logged step is no line: show the point
                drawn += 1
    if drawn:
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "no loss logged yet", ha="center", va="center", transform=ax.transAxes)
    if log_scale(rows):
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(LogFormatter(labelOnlyBase=False))  # 6 and 0.3, not 6×10⁰ and 3×10⁻¹
        ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.4)))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("loss (val_loss dashed)")
    ax.grid(True, alpha=0.3)
    return save_atomic(fig, Path(out_path), fmt)


def goodput_bars(ax: Any, rows: Sequence[Row]) -> int:
    """One bar per run: its wall time split into the goodput buckets (hpcjobs.goodput.buckets), as shares; the bars
    drawn."""
    from hpcjobs.goodput.buckets import BUCKETS

    shown = [r for r in rows if r.goodput_s]
    left = [0.0] * len(shown)
    for i, bucket in enumerate(BUCKETS):
        shares = [r.goodput_s.get(bucket, 0.0) / (sum(r.goodput_s.values()) or 1.0) for r in shown]
        ax.barh(range(len(shown)), shares, left=left, color=f"C{i}", label=bucket)
        left = [a + b for a, b in zip(left, shares, strict=True)]
    ax.set_yticks(range(len(shown)), [r.label for r in shown])  # two runs may share a label (their folders' name)
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_xlabel("share of wall time (goodput; ETTR = productive / allocated)")
    ax.legend(fontsize="x-small", ncols=4, loc="upper center", bbox_to_anchor=(0.5, -0.45))
    return len(shown)


def save_atomic(fig: Figure, path: Path, fmt: str) -> Path:
    try:
        with replacing(path) as tmp:
            fig.savefig(tmp, format=fmt)
    except OSError as e:
        raise RuntimeFailure(f"could not write the plot {path} ({e.strerror or e}).",
                             "pick a writable path for --plot.") from None
    return path
