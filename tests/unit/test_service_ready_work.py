"""The learner service's ready-work signal: each call learns whether more calls were queued
behind it when it started (``more_queued``), and ``ready_work`` runs after each call that had
none -- what ``LearnerEndpoint`` uses to hold a run of events' backward passes and pack them."""

from __future__ import annotations

import threading

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
