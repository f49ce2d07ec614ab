"""The stop protocol's signal handlers for the length of one library call (`Trainer.train`, `Trainer.fit`), shared by
the integrations. Inside it SIGINT, SIGTERM and the profile's signal only set the flag that the ranks agree on at
the step ends the cadence names (trainers/integrations/checks.py); once the call returns (or raises anything but the
stop's own exit) the handlers the script had before are back and the protocol's state is cleared, so the code after
the call stops on Ctrl-C, SIGTERM and `hpcjobs cancel` as usual instead of setting a flag nobody reads any more.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from typing import Any

from trainers import preemption
from trainers.integrations import check_every
from trainers.integrations.checks import StepEndGuard


def protocol_signals() -> list[int]:
    contract = preemption.current_contract()
    return sorted({preemption.signal_number(contract.preemption.signal), signal.SIGTERM, signal.SIGINT})


@contextlib.contextmanager
def joined(callback: Any) -> Iterator[None]:
    """Give `callback.guard` a fresh StepEndGuard (its handlers, its cadence) for the body; hand the signals back
    after it."""
    saved = {num: signal.getsignal(num) for num in protocol_signals()}
    callback.guard = StepEndGuard(every=check_every(os.environ))
    stopping = False
    try:
        yield
    except SystemExit:
        stopping = True  # the agreed stop (or the script's own exit): the rank ends with the protocol's handlers
        raise
    finally:
        if not stopping:
            preemption.reset()
            for num, handler in saved.items():
                signal.signal(num, handler)
