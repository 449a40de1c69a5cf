"""What every config section shares: strict validation, and the checks sections have in common."""

from __future__ import annotations

import ipaddress
from typing import Any

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    """Unknown keys are errors, assignments are validated, and no NaN or infinity anywhere (a
    non-finite ``failure_reward`` would reach the gradient ledger)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and ``localhost``. Other names count as exposed without a DNS
    lookup: validating a config must not depend on the network it runs on."""
    host = host.strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host.lower() in ("localhost", "localhost.localdomain")


def default_tag(value: Any, key: str, default: str) -> Any:
    """A union section given as a mapping without its discriminator ``key`` is its default kind
    (``sandbox: {num_uids: 32}`` is a local sandbox); a bare string is the kind itself."""
    if isinstance(value, str):
        return {key: value}
    if isinstance(value, dict) and key not in value:
        return {key: default, **value}
    return value
