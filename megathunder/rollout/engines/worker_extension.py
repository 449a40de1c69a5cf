"""The methods megathunder adds to every vLLM worker (``worker_extension_cls``): load weights sent
inside an RPC, and join / receive from / leave the weight-transfer group (``transfer.py``).

Imported by the vLLM worker processes, by name (``EXTENSION_CLS`` in ``common.py``).
"""

from __future__ import annotations

import base64
import json

from safetensors.torch import load

from megathunder.rollout.engines.transfer import Bucket, Rendezvous, TransferGroup, receive


class MegathunderWorkerExtension:
    """Methods vLLM mixes into each of its workers (``worker_extension_cls``).

    ``self`` is the vLLM worker; ``self.reload_weights`` is its in-place reloader.
    """

    megathunder_transfer: TransferGroup | None  # set by megathunder_transfer_join

    def megathunder_load_safetensors(self, payload_b64: str) -> int:
        """Load the base64 safetensors blob made by ``rpc.encode_tensors``; returns #tensors."""
        tensors = load(base64.b64decode(payload_b64))
        self.reload_weights(weights_iterator=iter(tensors.items()))  # type: ignore[attr-defined]
        return len(tensors)

    def megathunder_worker_rank(self) -> int:
        """This worker's rank among its engine's workers (the transfer group counts them)."""
        return self.rank  # type: ignore[attr-defined]

    def megathunder_transfer_join(self, rendezvous_json: str, rank_offset: str) -> int:
        """Join the weight-transfer group as rank ``rank_offset`` + this worker's rank; returns it."""
        rank = int(rank_offset) + self.rank  # type: ignore[attr-defined]
        rdv = Rendezvous.from_json(rendezvous_json)
        self.megathunder_transfer = TransferGroup.join(rdv, rank, self.device)  # type: ignore[attr-defined]
        return rank

    def megathunder_receive_buckets(self, plan_json: str) -> int:
        """Receive the broadcast buckets ``plan_json`` describes and reload from them, bucket by
        bucket; returns #tensors. One ``reload_weights`` (the model's ``load_weights`` between
        vLLM's layerwise-reload set-up and finish) consumes the buckets as they arrive, rather than
        one call per bucket: vLLM runs a layer's post-load processing once all of its tensors have
        been loaded, and a layer's tensors may span buckets."""
        group = getattr(self, "megathunder_transfer", None)
        if group is None:
            raise RuntimeError("this worker is in no weight-transfer group (never joined, or closed)")
        plan = [Bucket.from_json(b) for b in json.loads(plan_json)]
        tensors = receive(group, plan)
        self.reload_weights(weights_iterator=tensors)  # type: ignore[attr-defined]
        for _ in tensors:  # buckets the loader left unread: rank 0 broadcasts every one
            pass
        return sum(len(b.slots) for b in plan)

    def megathunder_transfer_close(self) -> None:
        group = getattr(self, "megathunder_transfer", None)
        if group is not None:
            group.close()
            self.megathunder_transfer = None
