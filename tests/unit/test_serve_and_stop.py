"""`megathunder serve`'s command line and environment, the trainer's stop-on-SIGUSR1 step range, and
a stop-now request that arrives while the run is closing."""

from __future__ import annotations

import signal
import threading

import pytest

from megathunder.config import load_config
from megathunder.rollout.serve import ServeError, serve_command, serve_env
from megathunder.trainer.interrupt import StopNow, StopSignals
from megathunder.trainer.run import StepsUntilSignal


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def test_serve_command_binds_the_node_address_with_tensor_parallel(model_dir):
    cfg = load_config("tests/cluster/grpo_cpu.yaml", ["rollout.engine.api_key_env=MT_TEST_KEY"])
    cmd = serve_command(cfg, 8123, "10.0.0.5", str(model_dir), tensor_parallel=2)
    flags = dict(zip(cmd, cmd[1:]))
    assert flags["--model"] == str(model_dir) and flags["--host"] == "10.0.0.5" and flags["--port"] == "8123"
    assert flags["--tensor-parallel-size"] == "2" and "--enable-scale-out" in cmd
    assert flags["--middleware"].endswith("BearerAuthMiddleware")  # the secret guards the weight endpoints
    with pytest.raises(ServeError, match="has no config.json"):
        serve_command(cfg, 8123, "10.0.0.5", str(model_dir / "missing"))


def test_serve_env_needs_a_secret_off_loopback(monkeypatch):
    monkeypatch.delenv("MT_TEST_KEY", raising=False)
    plain = load_config("tests/cluster/grpo_cpu.yaml")
    assert serve_env(plain, "127.0.0.1")["VLLM_SERVER_DEV_MODE"] == "1"
    with pytest.raises(ServeError, match="not loopback"):
        serve_env(plain, "10.0.0.5")
    keyed = load_config("tests/cluster/grpo_cpu.yaml", ["rollout.engine.api_key_env=MT_TEST_KEY"])
    with pytest.raises(ServeError, match="MT_TEST_KEY"):
        serve_env(keyed, "10.0.0.5")
    monkeypatch.setenv("MT_TEST_KEY", "s3cret")
    assert serve_env(keyed, "10.0.0.5")["VLLM_API_KEY"] == "s3cret"


def test_steps_until_signal_ends_after_the_current_step():
    stop = threading.Event()
    steps = StepsUntilSignal(range(3, 10), stop)
    assert (steps.start, steps.stop, len(steps)) == (3, 10, 7)
    done = []
    for step in steps:
        done.append(step)
        if step == 5:
            stop.set()  # SIGUSR1 during step 5: step 5 finishes, no step 6
    assert done == [3, 4, 5]


@pytest.fixture
def stop_signals():
    """StopSignals installs its handlers on this process; pytest's are put back after."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)}
    try:
        yield StopSignals
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_a_stop_request_while_closing_changes_nothing(stop_signals):
    """Outside the step loop stop-now raises; inside it, it cancels the controller; once the run
    closes (engine, learner) SIGTERM and SIGUSR1 are ignored -- an exception raised into vLLM's
    shutdown would leave its engine core alive and the interpreter waiting for it at exit, and the
    default actions Python restores at finalization would kill the process mid-exit -- and a Ctrl-C
    is only marked."""
    signals = stop_signals()
    with pytest.raises(StopNow):
        signals._stop_now(signal.SIGTERM, None)
    assert signals.now.is_set() and signals.after_step.is_set()
    cancelled = []
    signals.on_stop_now.append(lambda: cancelled.append(True))
    signals._stop_now(signal.SIGTERM, None)
    assert cancelled == [True]
    signals.closing()  # the callbacks stay registered, as in the trainer's close: none may run now
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN and signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
    signals._interrupt(signal.SIGINT, None)  # no exception, no cancel
    signals._stop_now(signal.SIGTERM, None)  # a SIGTERM already on its way when the handler changed
    assert cancelled == [True] and signals.now.is_set()
    signals.on_stop_now.clear()
    signals._stop_now(signal.SIGTERM, None)  # and without callbacks, no StopNow either
