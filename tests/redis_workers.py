"""Workers in one test process: registries on one Redis prefix, each a worker of its own."""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any

import sessionactors as sa
from sessionactors.stores import RedisStore
from sessionactors.testing import EchoModel

TTL = 1.0  # lease time-to-live of the workers open_worker opens: failovers take about a second


def open_worker(
    url: str,
    prefix: str,
    worker_id: str | None,
    model: sa.Model | None = None,
    *,
    agents: Mapping[str, sa.Agent] | None = None,
    balance: bool = False,
    lease_ttl: float = TTL,
    **options: Any,
) -> AbstractAsyncContextManager[sa.Registry]:
    """The registry of worker ``worker_id`` on the Redis at ``url`` under ``prefix``, with
    leases of ``lease_ttl`` seconds and ``agents`` (by default one, "echo", over ``model``,
    an ``EchoModel`` unless given); its sessions stay where they woke unless ``balance``.
    ``options`` go to ``sa.open_registry``."""
    if agents is None:
        agents = {"echo": sa.Agent(model=EchoModel() if model is None else model)}
    else:
        assert model is None, "give a model or agents, not both"
    store = RedisStore(url, prefix=prefix, balance=balance)
    return sa.open_registry(
        store=store, agents=agents, worker_id=worker_id, lease_ttl=lease_ttl, **options
    )
