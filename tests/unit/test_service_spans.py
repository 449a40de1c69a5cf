"""The learner service's spans: the busy seconds of a window and the window's trim, which read only
the newest and oldest spans (appended as calls end, in step order) -- the same figures as a pass over
all of them, which a run of ``run.timeline_steps`` steps made every step."""

from __future__ import annotations

import random

from megathunder.learner.service import LearnerService, Span


def test_busy_seconds_and_the_trim_equal_a_pass_over_every_span():
    service = LearnerService(object())
    try:
        rng, t, spans = random.Random(0), 0.0, []
        for step in range(50):
            for _ in range(rng.randint(1, 6)):
                start = t + rng.random()
                t = start + rng.random()
                spans.append(Span(rng.choice(["close", "step", "reward"]), start, t, step))
        service.spans = list(spans)
        for _ in range(200):
            since, until = sorted(rng.uniform(-1, t + 1) for _ in range(2))
            kinds = rng.choice([None, {"close"}, {"step", "reward"}])
            full = sum(max(0.0, min(s.end, until) - max(s.start, since))
                       for s in spans if kinds is None or s.kind in kinds)
            assert abs(service.busy_seconds(since, until, kinds) - full) <= 1e-9 * max(1.0, full)
        service.forget_spans_before(20)
        assert service.spans == [s for s in spans if s.step >= 20]
        service.forget_spans_before(20)  # nothing older left: nothing changes
        assert service.spans == [s for s in spans if s.step >= 20]
    finally:
        service.stop()


def test_the_timeline_keeps_the_steps_of_its_window():
    """``Timeline.keep_from`` drops the front of its episode and sync lists (``drop_front``, as the
    service's spans): episodes of earlier steps, syncs of earlier versions (version v follows step
    v - 1), and nothing once only newer entries are left."""
    from megathunder.trainer.timeline import Timeline

    timeline = Timeline(episodes=[{"step": s} for s in (0, 0, 1, 2, 2, 3)],
                        syncs=[(float(v), v + 0.5, v) for v in range(5)])
    timeline.keep_from(2)
    assert [e["step"] for e in timeline.episodes] == [2, 2, 3]
    assert [s[2] for s in timeline.syncs] == [2, 3, 4]
    timeline.keep_from(2)
    assert [e["step"] for e in timeline.episodes] == [2, 2, 3] and len(timeline.syncs) == 3
    timeline.keep_from(9)
    assert timeline.episodes == [] and timeline.syncs == []
