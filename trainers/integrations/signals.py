"""The stop protocol's signal handlers for the length of one library call (`Trainer.train`, `Trainer.fit`), shared by
the integrations. Inside it SIGINT, SIGTERM and the profile's signal only set the flag that the ranks agree on at
the step ends the cadence names (trainers/integrations/checks.py); once the call returns (or raises anything but the
stop's own exit) the handlers the script had before are back and the protocol's state is cleared, so the code after
the call stops on Ctrl-C, SIGTERM and `hpcjobs cancel` as usual instead of setting a flag nobody reads any more; a
signal that came after the ranks' last agreement is handed to those handlers as the call returns (or, when the call
is a loop the script left with `break`, a moment later: `resend_soon`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

from hpcjobs.protocol import userstop
from hpcjobs.protocol.runfolder import RunFolder
from trainers import preemption
from trainers.integrations import check_every
from trainers.integrations.checks import StepEndGuard


def protocol_signals() -> list[int]:
    contract = preemption.current_contract()
    return sorted({preemption.signal_number(contract.preemption.signal), signal.SIGTERM, signal.SIGINT})


@contextlib.contextmanager
def joined(callback: Any) -> Iterator[None]:
    """Give `callback.guard` a fresh StepEndGuard (its handlers, its cadence) for the body; hand the signals back
    after it, and with them a signal the ranks never agreed on (`unheard`)."""
    saved = {num: signal.getsignal(num) for num in protocol_signals()}
    callback.guard = StepEndGuard(every=check_every(os.environ))
    stopping = returned = left = False
    in_protocol(True)
    try:
        yield
        returned = True
    except SystemExit:
        stopping = True  # the agreed stop (or the script's own exit): the rank ends with the protocol's handlers
        raise
    except GeneratorExit:
        returned = left = True  # the body is a loop's generator the script left (`break`): its end, as a return
        raise
    finally:
        if not stopping:
            in_protocol(False)
            if returned:  # every rank started the last check's reduce: wait for it before the script goes on
                callback.guard.close()
            late = unheard() if returned else None
            preemption.reset()
            for num, handler in saved.items():
                signal.signal(num, handler)
            if late is not None:
                (resend_soon if left else signal.raise_signal)(late)


def in_protocol(now: bool) -> None:
    """Rank 0 of a local job: whether the script is in the stop protocol now, for the launcher's Ctrl-C line
    (hpcjobs.protocol.userstop)."""
    if os.environ.get("RANK", "0") == "0":
        contract = preemption.current_contract()
        run = RunFolder(contract.run_dir) if contract.run_dir != preemption.NO_RUN_FOLDER else None
        userstop.set_joined(run, os.environ.get("HPCJOBS_JOB_ID"), now)


RESEND_S = 0.05
"""How long after a left loop's end its late signal is sent again (`resend_soon`)."""


def resend_soon(num: int) -> None:
    """Send `num` to this process again from a thread, RESEND_S from now. For a loop the script left with `break`:
    its generator is closed as the script drops it, and an exception a handler raised there (Ctrl-C's
    KeyboardInterrupt) would be lost ("Exception ignored in: <generator ...>"); RESEND_S later the main thread is
    back in the script's own code, which the handler then interrupts."""
    def send() -> None:
        time.sleep(RESEND_S)
        os.kill(os.getpid(), num)

    with contextlib.suppress(RuntimeError):  # closed at the interpreter's exit: the script is over, no thread starts
        threading.Thread(target=send, name="hpcjobs-late-signal", daemon=True).start()


def unheard() -> int | None:
    """A signal that came after the ranks' last agreement (its step end was the call's last, or the call was past
    its steps): the call returned without stopping for it. It goes to the handler the script had before the call,
    as if it had come just after: Ctrl-C raises KeyboardInterrupt where the call returns, SIGTERM and `hpcjobs
    cancel` stop the script, and the profile's signal does what it does to a script that never joined
(trainers.standby: under Slurm rank 0 requeues the job, which resumes from its newest checkpoint; locally it stops
the script as Ctrl-C does).
    Dropped, the code after the call ran on deaf to it."""
    first = preemption.first_request()
    if first is None or first[0] == "deadline":
        return None  # asked by the clock, not by a signal: nothing to hand over
    return int(getattr(signal, first[0]))
