"""The registry's options, validated once when it opens.

Pure: no trio, no I/O. Every option is checked for its type and range here,
so that a bad value fails ``open_registry`` with an error that names it,
instead of failing a session later.
"""

import math
from typing import Literal

import attrs

from ._records import check_printable, check_unicode

__all__ = ["Durability", "HubConfig", "RegistryConfig", "make_config"]

Durability = Literal["turn", "hibernate"]

#: Seconds a write that must finish (a final snapshot, a stop) may take before
#: the registry gives up on it.
WRITE_BOUND = 30.0


@attrs.frozen(kw_only=True)
class HubConfig:
    """Bounds of the replay ring (events and bytes) and of each subscriber's buffer."""

    replay_events: int = 1000
    replay_bytes: int = 1 << 20
    subscriber_buffer: int = 1000


@attrs.frozen(kw_only=True)
class RegistryConfig:
    """The registry's options (see ``open_registry``)."""

    idle_timeout: float | None = None
    mailbox_size: int = 64
    shutdown_grace: float = 10.0
    max_restarts: int = 3
    restart_window: float = 5.0
    durability: Durability = "turn"
    snapshot_every: int = 1000
    journal_keep_events: int = 100_000
    write_bound: float = WRITE_BOUND
    leases: bool = False
    lease_ttl: float = 30.0
    worker_id: str | None = None
    hub: HubConfig = attrs.field(factory=HubConfig)


def _seconds(name: str, value: object, *, zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"open_registry: {name} must be a number of seconds, not {value!r}")
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        least = "0 or more" if zero else "more than 0"
        raise ValueError(
            f"open_registry: {name} must be a finite number of seconds, {least}, not {value!r}"
        )
    return float(value)


def _count(name: str, value: object, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"open_registry: {name} must be an int, not {value!r}")
    if value < least:
        raise ValueError(f"open_registry: {name} must be at least {least}, not {value!r}")
    return value


def make_config(
    *,
    idle_timeout: object,
    mailbox_size: object,
    shutdown_grace: object,
    max_restarts: object,
    restart_window: object,
    durability: object,
    replay_events: object,
    replay_bytes: object,
    subscriber_buffer: object,
    snapshot_every: object,
    journal_keep_events: object,
    leases: object,
    lease_ttl: object,
    worker_id: object,
) -> RegistryConfig:
    """The registry's configuration; ``TypeError`` / ``ValueError`` naming the bad option."""
    if durability not in ("turn", "hibernate"):
        raise ValueError(
            f"open_registry: durability must be 'turn' or 'hibernate', not {durability!r}"
        )
    if leases is not None and not isinstance(leases, bool):
        raise TypeError(f"open_registry: leases must be True, False or None, not {leases!r}")
    if worker_id is not None and (not isinstance(worker_id, str) or not worker_id):
        raise ValueError(
            f"open_registry: worker_id must be a non-empty string or None, not {worker_id!r}"
        )
    if worker_id is not None:
        check_unicode(worker_id, "open_registry: worker_id")
        check_printable(worker_id, f"open_registry: worker_id {worker_id!r}")
    return RegistryConfig(
        idle_timeout=None if idle_timeout is None else _seconds("idle_timeout", idle_timeout),
        mailbox_size=_count("mailbox_size", mailbox_size, 1),
        shutdown_grace=_seconds("shutdown_grace", shutdown_grace, zero=True),
        max_restarts=_count("max_restarts", max_restarts, 0),
        restart_window=_seconds("restart_window", restart_window),
        durability=durability,
        snapshot_every=_count("snapshot_every", snapshot_every, 1),
        journal_keep_events=_count("journal_keep_events", journal_keep_events, 0),
        leases=bool(leases),
        lease_ttl=_seconds("lease_ttl", lease_ttl),
        worker_id=worker_id,
        hub=HubConfig(
            replay_events=_count("replay_events", replay_events, 0),
            replay_bytes=_count("replay_bytes", replay_bytes, 0),
            subscriber_buffer=_count("subscriber_buffer", subscriber_buffer, 1),
        ),
    )
