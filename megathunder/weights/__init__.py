"""The weight push's wire, below the learner and the rollout side (``wire.py``).

The learner's stage senders (``learner/push.py``) write frames into one process group per pipeline
stage; every vLLM worker (``rollout/engines/worker_extension.py``) reads them; the engine
(``rollout/engines/transfer.py``) serves the groups' store and posts its workers' receives; the
controller (``trainer/weight_sync.py``) runs the two ends at once. Each of them imports the wire,
and none imports another's side.
"""
