"""megathunder: on-policy RL and distillation for LLM agents with exact gradient streaming.

The package is organised by component (``docs/design.md`` has a line per module):

- ``config``      typed, validated configuration, one file per component (YAML + ``key=value``)
- ``objectives``  the loss library shared by the batch reference and the streaming paths
- ``streaming``   ThunderSyncRL's core: the gradient ledger, per-turn OPD, their batch references
- ``learner``     everything on a learner rank: Megatron model and learner, batches, the endpoint
- ``rollout``     vLLM engines, the agent loop, tools, sandboxes, verifiers, tasks
- ``weights``     the weight push's wire (frames, groups, rendezvous), below the learner and rollout
- ``trainer``     the rank-0 controller: ``megathunder train``, the schedules, the weight sync, replay, run outputs
- ``eval``        pass@k on held-out instances, schedule comparison reports
- ``bench``       ``megathunder bench NAME``, ``megathunder sweep``, the exactness demo
- ``simulate``    the discrete-event simulator of the schedules at cluster scale
- ``models``      the tiny Qwen2 and its tokenizer; the small torch decoder of the exactness tests
- ``console``     what a person reads: third-party noise filtered (``-v`` shows it)
- ``cpu_cores``   the learner's and the rollout engine's own CPU cores on a shared machine
- ``trajectory``  the unit of RL data
"""

__version__ = "0.1.0"
