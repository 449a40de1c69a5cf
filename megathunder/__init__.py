"""megathunder: on-policy RL and distillation for LLM agents with exact gradient streaming.

The package is organised by component:

- ``config``      typed, validated configuration (YAML + ``key=value`` overrides)
- ``objectives``  the loss library shared by the batch reference and the streaming path
- ``streaming``   the gradient ledger (ThunderSyncRL's core) and its gradient backends
- ``reference``   the batch-synchronous reference gradient every streamed update is checked against
- ``models``      model definitions
- ``bench``       ``megathunder bench NAME`` benchmarks
"""

__version__ = "0.1.0"
