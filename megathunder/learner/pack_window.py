"""``PackWindow``: how long an idle learner's event call waits for the next call before it decides.

Events come in bursts (a batch of sequences finishing in one engine step), and a burst's first
event would otherwise start a one-trajectory backward pass that the rest of the burst waits
behind. So an event call (a method the endpoint lists in ``WINDOW_CALLS``) that finds nothing
queued behind it, while the endpoint holds work (packing on), waits up to ``seconds`` for the next
call: if one arrives, the event is told more is queued and its work is held for the packed pass
after the burst (``LearnerService``, "Ready work"). Only events wait, only on an idle learner, and
only when packing is on; what is computed is the same either way (``GradientLedger.hold``).

With a generation hold (``hold_while``: the rollout engine computes on the learner's own cores or
devices, ``ledger.hold_while_generating``), the window stays open past ``seconds`` while it returns
true: a backward pass started then would take compute from the sequences still generating, and the
work goes packed once they pause -- after one more ``seconds``: the sequences of generation's last
steps are still on their way to the learner when the engine stops (measured on SmolLM2: the first
of them would start a pass over half the batch that the other half then waited behind).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

GENERATING_POLL_S = 0.005
"""How often a window kept open by the generation hold asks again."""


class PackWindow:
    """The service's pack-window policy (module docstring); ``seconds`` 0: no window."""

    def __init__(self, seconds: float = 0.0, generating: Callable[[], bool] | None = None) -> None:
        self.seconds = seconds
        self._generating = generating

    def hold_while(self, generating: Callable[[], bool] | None) -> None:
        """Keep windows open while ``generating()`` (called from the learner thread); None: never."""
        self._generating = generating

    @property
    def open(self) -> bool:
        return self.seconds > 0

    def wait(self, cond: threading.Condition, arrived: Callable[[], bool], ended: Callable[[], bool]) -> bool:
        """(``cond``'s lock held) Whether the next call ``arrived()`` within the window; ``ended()``:
        the window closes early (a call, or a message that is not a call)."""
        if cond.wait_for(ended, timeout=self.seconds):
            return arrived()
        held = False
        generating = self._generating
        while generating is not None and generating():
            held = True
            if cond.wait_for(ended, timeout=GENERATING_POLL_S):
                return arrived()
        if held:  # generation ended: the sequences of its last steps reach the learner as a burst now
            return cond.wait_for(ended, timeout=self.seconds) and arrived()
        return False
