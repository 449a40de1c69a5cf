"""The learner service's ready-work signal: each call learns whether more calls were queued
behind it when it started (``more_queued``), and ``ready_work`` runs after each call that had
none -- what ``LearnerEndpoint`` uses to hold a run of events' backward passes and pack them."""

from __future__ import annotations

import threading
import time

import pytest

from megathunder.learner.pack_window import PackWindow
from megathunder.learner.service import LearnerService


class Recorder:
    def __init__(self) -> None:
        self.more_queued = False
        self.seen: list[tuple[str, bool]] = []
        self.started, self.gate = threading.Event(), threading.Event()

    def block(self) -> None:
        self.seen.append(("block", self.more_queued))
        self.started.set()
        assert self.gate.wait(timeout=30), "the test never opened the gate"

    def event(self, k: int) -> None:
        self.seen.append((f"event{k}", self.more_queued))

    def ready_work(self) -> None:
        self.seen.append(("ready", self.more_queued))


def test_calls_queued_behind_others_are_told_and_ready_work_follows_the_last():
    rec = Recorder()
    service = LearnerService(rec)
    try:
        first = service.submit(Recorder.block)
        assert rec.started.wait(timeout=30)  # running, with nothing queued behind it yet
        events = [service.submit(Recorder.event, k) for k in range(3)]  # queued behind it
        rec.gate.set()
        for f in (first, *events):
            f.result(timeout=30)
        service.submit(Recorder.event, 3).result(timeout=30)  # alone in the queue
    finally:
        service.stop()
    assert rec.seen == [("block", False), ("ready", False),
                        ("event0", True), ("event1", True), ("event2", False), ("ready", False),
                        ("event3", False), ("ready", False)]


class Windowed(Recorder):
    """An endpoint whose ``event`` calls may wait for the next call (``PackWindow``)."""

    WINDOW_CALLS = ("event",)

    def __init__(self, packing: bool = True) -> None:
        super().__init__()
        self._packing = packing

    def packing(self) -> bool:
        return self._packing

    def done(self) -> None:
        self.seen.append(("done", self.more_queued))


@pytest.mark.parametrize("window_s, told", [(60.0, True), (0.0, False)], ids=["window", "no_window"])
def test_an_event_on_an_idle_learner_waits_for_the_next_call_within_the_window(window_s, told):
    """The first event starts with nothing queued (the test submits the next call only once it
    has started); within the window (60 s here, so the test cannot race it) that call
    arrives and the event is told more is queued. Without the window it is not: the control."""
    rec = Windowed()
    service = LearnerService(rec, window=PackWindow(window_s))
    try:
        first = service.submit(Windowed.event, 0)
        deadline = time.monotonic() + 30
        while service._num_started < 1:  # the event has taken its place; nothing is queued behind it
            assert time.monotonic() < deadline, "the first call never started"
            time.sleep(0.001)
        rest = service.submit(Windowed.done)
        for f in (first, rest):
            f.result(timeout=30)  # well within the window: the event was woken by the next call
    finally:
        service.stop()
    assert rec.seen[0] == ("event0", told)


def _started(service: LearnerService, calls: int) -> None:
    deadline = time.monotonic() + 30
    while service._num_started < calls:
        assert time.monotonic() < deadline, "the call never started"
        time.sleep(0.001)


def test_the_window_stays_open_while_the_engine_generates_and_closes_when_it_stops():
    """``generating`` (the in-process engine has sequences in flight) keeps an event's window open
    far past the window (1 ms): the next call, submitted only after the window's own bound,
    still finds the event waiting and it is told more is queued. When generation stops with no
    call behind it, the window closes (the event runs with nothing queued; bounded by the poll)."""
    rec = Windowed()
    generating = threading.Event()
    generating.set()
    service = LearnerService(rec, window=PackWindow(0.001, generating.is_set))
    try:
        first = service.submit(Windowed.event, 0)
        _started(service, 1)
        time.sleep(0.05)  # 50 x the window: only ``generating`` can still hold it open
        rest = service.submit(Windowed.done)
        for f in (first, rest):
            f.result(timeout=30)
        assert rec.seen[0] == ("event0", True)
        second = service.submit(Windowed.event, 1)
        _started(service, 3)
        generating.clear()  # the engine's sequences finished: nothing follows the event
        second.result(timeout=30)
    finally:
        generating.clear()
        service.stop()
    assert rec.seen[-2:] == [("event1", False), ("ready", False)]


def test_when_generation_ends_the_window_waits_once_more_for_the_burst_it_releases():
    """The engine's last sequences reach the learner just after it stops generating: the window
    held open by ``generating`` waits the window once more after it turns false, and the
    call that arrives then finds the event waiting. ``generating`` itself starts that call on
    another thread the moment it first answers false: the call needs the service's lock, which the
    window releases only when it waits, so it arrives during that wait and never before."""
    rec = Windowed()
    answers = iter([True, False])
    follow: list[threading.Thread] = []

    def generating() -> bool:
        now = next(answers, False)
        if not now and not follow:  # the burst generation's end releases
            follow.append(threading.Thread(target=lambda: service.submit(Windowed.done)))
            follow[0].start()
        return now

    service = LearnerService(rec, window=PackWindow(1.0, generating))
    try:
        service.submit(Windowed.event, 0).result(timeout=30)
        follow[0].join(timeout=30)
    finally:
        service.stop()
    assert rec.seen[0] == ("event0", True)


def test_stop_ends_a_window_held_open_by_generation():
    """A message that is not a call (stop, a learner fault) ends the window: the event runs with
    nothing queued, then the service stops, though the engine still generates."""
    rec = Windowed()
    service = LearnerService(rec, window=PackWindow(0.001, lambda: True))
    first = service.submit(Windowed.event, 0)
    _started(service, 1)
    service.stop()  # returns only after the event ran: the window did not outlast it
    assert first.done() and rec.seen == [("event0", False), ("ready", False)]


def test_the_window_ends_at_its_bound_and_only_events_of_a_packing_batch_wait():
    """Nothing follows: the event runs after the window with nothing queued. A call not in
    ``WINDOW_CALLS``, or any call while the batch does not pack, never waits (a 60 s window would
    show as a 60 s call: each must finish well within it)."""
    rec = Windowed()
    service = LearnerService(rec, window=PackWindow(0.05))
    try:
        service.submit(Windowed.event, 0).result(timeout=30)
    finally:
        service.stop()
    assert rec.seen == [("event0", False), ("ready", False)]
    for endpoint, method in ((Windowed(), Windowed.ready_work), (Windowed(packing=False), Windowed.event)):
        service = LearnerService(endpoint, window=PackWindow(60.0))
        try:
            args = (0,) if method is Windowed.event else ()
            service.submit(method, *args).result(timeout=30)  # would take 60 s if it waited
        finally:
            service.stop()


class Evented(Windowed):
    """An endpoint whose ``event`` calls may also be sent in bursts (``submit_event``)."""

    EVENT_CALLS = ("event",)


def test_a_burst_of_events_runs_as_the_same_events_queued_one_by_one_would():
    """Events queued with ``submit_event`` and sent by ``flush_events`` in one message: each runs
    as its own call, in order, with more queued behind all but the last, then ``ready_work`` --
    what the first test sees for the same events submitted one by one behind a running call. Each
    keeps its own span."""
    rec = Evented()
    service = LearnerService(rec)
    try:
        first = service.submit(Evented.block)
        assert rec.started.wait(timeout=30)
        assert [service.submit_event(Evented.event, k) for k in range(3)] == [True, False, False]
        assert service._num_submitted == 1  # nothing is sent before the flush
        service.flush_events()
        service.flush_events()  # nothing queued: nothing sent
        last = service.submit(Evented.done)
        rec.gate.set()
        for f in (first, last):
            f.result(timeout=30)
    finally:
        service.stop()
    assert rec.seen == [("block", False), ("ready", False), ("event0", True), ("event1", True), ("event2", True),
                        ("done", False), ("ready", False)]
    assert [s.kind for s in service.spans] == ["block", "event", "event", "event", "done"]


def test_any_other_call_or_stop_sends_the_queued_events_first():
    """Calls keep their submission order: a call submitted after events that were not flushed yet
    runs after them, and stop runs them before it stops."""
    rec = Evented()
    service = LearnerService(rec)
    try:
        service.submit_event(Evented.event, 0)
        service.submit(Evented.done).result(timeout=30)
        service.submit_event(Evented.event, 1)
    finally:
        service.stop()
    assert [name for name, _ in rec.seen if name != "ready"] == ["event0", "done", "event1"]


def test_only_event_calls_may_be_sent_in_bursts():
    service = LearnerService(Evented())
    try:
        with pytest.raises(TypeError, match="not an event call"):
            service.submit_event(Evented.done)
    finally:
        service.stop()


def test_a_burst_whose_last_event_finds_nothing_queued_waits_the_window():
    """The burst's last event is an event call on an idle learner: it waits the pack window like a
    lone event, and the call that arrives within it (60 s: the test cannot race it) tells it more
    is queued."""
    rec = Evented()
    service = LearnerService(rec, window=PackWindow(60.0))
    try:
        service.submit_event(Evented.event, 0)
        service.submit_event(Evented.event, 1)
        service.flush_events()
        _started(service, 1)
        service.submit(Evented.done).result(timeout=30)
    finally:
        service.stop()
    assert rec.seen[:2] == [("event0", True), ("event1", True)]
