"""TensorBoard: scalars in RUN/tensorboard through torch.utils.tensorboard (see trainers/tracking/__init__.py)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from hpcjobs.protocol.runfolder import RunFolder
from trainers.tracking.common import Job, TrackerFile, import_package


class TensorBoardTracker:
    """Scalars in RUN/tensorboard, all starts in one folder: TensorBoard hides an earlier start's events from the
    resumed step on (`purge_step`), so a step shows the value of the start that kept it."""

    def __init__(self, run: RunFolder, state: TrackerFile, job: Job, config: dict[str, Any],
                 start_step: int) -> None:
        import_package("tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run.path / "tensorboard"), purge_step=start_step + 1)
        entry = state.entry("tensorboard")
        if not entry.get("config_logged"):
            self.writer.add_text("config", f"```\n{json.dumps(config, indent=1, sort_keys=True)}\n```", 0)
            entry["config_logged"] = True
            state.save()

    def log(self, values: Mapping[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def close(self, finished: bool) -> None:
        self.writer.close()


LOGS_ONCE = False
"""Whether a step already in the tracker's run is left out on a resume (TensorBoard hides an earlier start's events
from the resumed step on: purge_step)."""


def open_run(run: RunFolder, state: TrackerFile, job: Job, config: dict[str, Any],
             start_step: int) -> TensorBoardTracker:
    return TensorBoardTracker(run, state, job, config, start_step)
