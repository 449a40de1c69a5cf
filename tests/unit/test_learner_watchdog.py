"""Rank 0's watchdog over the learner ranks (``megathunder.learner.liveness``): which ranks it names,
and when, from the beats in the store; and ``learner.watchdog`` checked by field. The real thing,
with a SIGSTOPped and a wedged rank, is ``tests/distributed/test_rank_hang.py``."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from megathunder.config import ConfigError, load_config
from megathunder.learner.liveness import STOPS_RESUMABLY, InFlight, Watchdog, alive_key, call_key


def watchdog(calls: dict[int, str], heartbeat_timeout_s: float = 1000, call_timeout_s: float = 100) -> Watchdog:
    """A watchdog over ranks 1..len(calls) of an in-process store, its thread stopped before its first read."""
    store = dist.HashStore()
    for rank, call in calls.items():
        store.set(alive_key(rank), "1.0")
        store.set(call_key(rank), call)
    dog = Watchdog(SimpleNamespace(store=store, world_size=len(calls) + 1), lambda: None,  # type: ignore[arg-type]
                   heartbeat_timeout_s, call_timeout_s)
    dog.stop()
    dog._read()
    return dog


def test_a_call_within_its_bounds_names_nobody():
    dog = watchdog({1: "5 4 step", 2: "5 4 step"}, heartbeat_timeout_s=30)
    now = time.monotonic()
    assert dog.verdict(InFlight(5, "step", now - 70), now + 20) is None  # 90 s of 100, 20 s of 30


def test_a_silent_heartbeat_names_that_rank_only():
    dog = watchdog({1: "5 4 step", 2: "5 4 step"}, heartbeat_timeout_s=10)
    now = time.monotonic() + 11
    dog._seen[2].alive_changed = now - 1  # rank 2 beat a second ago
    line = dog.verdict(InFlight(5, "step", now - 11), now)
    assert line is not None and line.endswith(STOPS_RESUMABLY)
    assert "rank 1 hung (no heartbeat for 11" in line and "rank 2" not in line, line
    # the service's own messages (stop, a chaos fault) are watched for silence too
    assert "rank 1 hung" in (dog.verdict(InFlight(6, "stop", now - 11, is_call=False), now) or "")


def test_the_call_bound_names_the_ranks_that_have_not_finished_the_call():
    dog = watchdog({1: "5 5 step", 2: "5 4 step", 3: "4 4 finished"})
    now = time.monotonic() + 101
    line = dog.verdict(InFlight(5, "step", now - 101), now)
    assert line is not None and "learner call 5 ('step'), in flight for 101" in line, line
    assert "rank 2 hung (in call 5 ('step') for" in line and "heartbeat alive" in line, line
    assert "rank 3 hung (finished call 4, not started the next" in line, line
    assert "rank 1" not in line and "rank 0" not in line, line


def test_rank_0_is_named_when_every_other_rank_finished_the_call():
    dog = watchdog({1: "5 5 step", 2: "5 5 step"})
    now = time.monotonic() + 101
    line = dog.verdict(InFlight(5, "step", now - 101), now)
    assert line is not None and "rank 0 hung (every other rank finished the call" in line, line


def test_the_call_bound_is_off_at_0_and_for_the_services_own_messages():
    now = time.monotonic() + 500  # the call bound is 100 s, the heartbeat bound 1000 s
    assert watchdog({1: "5 4 step"}, call_timeout_s=0).verdict(InFlight(5, "step", now - 499), now) is None
    assert watchdog({1: "5 4 step"}).verdict(InFlight(6, "stop", now - 499, is_call=False), now) is None


def test_watchdog_defaults_never_fire_on_slow_calls():
    w = load_config(None, []).learner.watchdog
    assert w.heartbeat_timeout_s == 30 and w.call_timeout_s == 0


@pytest.mark.parametrize("override,field,words", [
    ("learner.watchdog.heartbeat_timeout_s=2", "learner.watchdog.heartbeat_timeout_s", "greater than or equal to 3"),
    ("learner.watchdog.heartbeat_timeout_s=.nan", "learner.watchdog.heartbeat_timeout_s", "finite"),
    ("learner.watchdog.call_timeout_s=5", "learner.watchdog.call_timeout_s", "at least 10 s"),
    ("learner.watchdog.call_timeout_s=-1", "learner.watchdog.call_timeout_s", "greater than or equal to 0"),
    ("learner.watchdog.call_timeout_s=1e9", "learner.watchdog.call_timeout_s", "less than or equal to"),
    ("learner.watchdog.stall_s=3", "learner.watchdog.stall_s", ""),
])
def test_bad_watchdog_bounds_are_refused_by_field(override, field, words):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert field in str(err.value) and words in str(err.value), str(err.value)
