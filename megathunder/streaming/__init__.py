"""ThunderSyncRL's streaming core: the gradient ledger and the gradient backends it drives."""

from megathunder.streaming.buffers import BufferPool, GradBuffer, GradientBackend
from megathunder.streaming.ledger import BatchResult, GradientLedger, LedgerError
from megathunder.streaming.torch_backend import TorchBackend

__all__ = [
    "BatchResult",
    "BufferPool",
    "GradBuffer",
    "GradientBackend",
    "GradientLedger",
    "LedgerError",
    "TorchBackend",
]
