"""Liveness probes of the multi-worker layer: every caller and stream of a session on
another worker gets an outcome or a typed error in bounded time, and nothing
acknowledged is lost."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import trio

import sessionactors as sa
from sessionactors.stores import RedisStore
from sessionactors.testing import EchoModel

pytestmark = pytest.mark.redis

TTL = 1.0


def open_worker(url: str, prefix: str, worker_id: str, model: Any = None, **options: Any) -> Any:
    """A registry on ``url`` under ``prefix`` whose sessions stay where they woke."""
    store = RedisStore(url, prefix=prefix, balance=False)
    options.setdefault("lease_ttl", TTL)
    agents = {"echo": sa.Agent(model=model or EchoModel())}
    return sa.open_registry(store=store, agents=agents, worker_id=worker_id, **options)


async def test_a_turn_submitted_nowait_to_a_session_live_elsewhere_reads_failed(
    redis_url: str,
) -> None:
    """A submit_nowait turn refused because its session is live on another worker reads failed (with why) from turn_outcome on the worker that refused it, not queued forever."""
    prefix = f"sa-test:{uuid.uuid4().hex}"
    with trio.fail_after(30):
        async with open_worker(redis_url, prefix, "a") as a, open_worker(redis_url, prefix, "b") as b:
            await a.spawn("s")
            await a.ref("s").history()  # live on a
            turn = b.ref("s").submit_nowait("hello")
            with pytest.raises(sa.SessionBusyError):
                await turn.reply()
            outcome = await b.ref("s").turn_outcome(turn.id)
            assert outcome.status is sa.TurnStatus.FAILED, outcome
            assert outcome.error is not None
            assert "another worker" in outcome.error
            assert await a.ref("s").history() == []  # it never ran
