"""SIGINT / SIGTERM during training: finish the step in flight, write a checkpoint, stop. A
second signal stops at once (KeyboardInterrupt), as users expect of a second Ctrl-C."""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequests:
    """A context manager that catches the signals; ``signum`` is the first one caught (0:
    none). Outside the main thread (where Python cannot install handlers) it catches nothing."""

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum:
            raise KeyboardInterrupt
        self.signum = signum
        name = signal.Signals(signum).name
        print(
            f"\nfusetune: {name}: finishing this step, then writing a checkpoint "
            "(send it again to stop at once)",
            file=sys.stderr,
            flush=True,
        )
