"""Probes of RedisStore at its edges: URLs with odd options, faults under a live registry."""

from __future__ import annotations

import uuid

import pytest
import trio

import sessionactors as sa
from sessionactors.stores import RedisStore

pytestmark = pytest.mark.redis


def _new_prefix() -> str:
    return f"sa-probe-{uuid.uuid4().hex[:8]}"


# -- URLs ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "says"),
    [
        # the client would decode replies (the store reads bytes) or ask for none
        ("redis://127.0.0.1:6379/0?decode_responses=true", "decode_responses"),
        ("redis://127.0.0.1:6379/0?noreply=yes", "noreply"),
        ("redis://127.0.0.1:6379/0?connection_class=x", "connection_class"),
        # a misspelt option of the store's own: no replica would be waited for
        ("redis://127.0.0.1:6379/0?replica=1", "replica"),
        ("redis://127.0.0.1:6379/0?persistance=volatile", "persistance"),
        # a TLS option on a URL without TLS
        ("redis://127.0.0.1:6379/0?ssl_ca_certs=/etc/ca.pem", "rediss://"),
        # a port or a database that no server can have
        ("redis://127.0.0.1:notaport/0", "port"),
        ("redis://127.0.0.1:99999/0", "port"),
        ("redis://127.0.0.1:6379/0?db=abc", "database"),
        ("redis://127.0.0.1:6379/1?db=2", "database"),
        ("redis+cluster://127.0.0.1:99999", "port"),
        # a cluster has one database: a path would be dropped without a word
        ("redis+cluster://127.0.0.1:7000/3", "database"),
    ],
)
def test_a_url_the_store_cannot_use_as_written_is_refused_at_construction(
    url: str, says: str
) -> None:
    """An option that breaks the store (replies decoded to text, no replies), one that
    nothing reads (a misspelling: ``?replica=1`` would wait for no replica), a TLS option
    without TLS, a port out of range and a database in a cluster URL are refused when the
    store is built, with a ValueError naming what to change; before, they were accepted
    and then either ignored or failed every call with a StoreError that says to retry."""
    with pytest.raises(ValueError, match=says) as caught:
        RedisStore(url)
    assert "redis url" in str(caught.value)


def test_the_client_options_that_work_are_still_accepted() -> None:
    """The client's own options the store can live with still pass (positive control)."""
    for url in [
        "redis://127.0.0.1:6379/0?client_name=app&max_connections=20&connect_timeout=2",
        "redis://127.0.0.1:6379?stream_timeout=3&max_idle_time=30&timeout=5&db=2",
        "redis://127.0.0.1:6379/2?db=2&persistence=everysec&replicas=1",
        "rediss://127.0.0.1:6380/0?ssl_cert_reqs=none&ssl_ca_certs=/etc/ca.pem",
        "unix:///run/redis.sock?db=1",
        "redis://:secret@127.0.0.1/0?noevict=true&notouch=true",
    ]:
        assert RedisStore(url).url == url


async def test_an_odd_option_does_not_fail_every_call(redis_url: str) -> None:
    """Negative control at the call: a URL accepted at construction works at its first call."""
    store = RedisStore(f"{redis_url}?client_name=probe&connect_timeout=2", prefix=_new_prefix())
    with trio.fail_after(10):
        await store.create("s", b"snap", b"i")
        assert await store.exists("s")
        await store.delete("s")
        await store.aclose()
    assert issubclass(sa.StoreError, sa.SessionActorsError)
