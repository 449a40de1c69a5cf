"""The rollout side: inference engines (vLLM), the multi-turn agent loop, sandboxes, verifiers, tasks.

Everything here produces *timed events* (turn finished, trajectory finished, reward arrived) that
the trainer routes to the learner's gradient ledger the moment they happen.
"""
