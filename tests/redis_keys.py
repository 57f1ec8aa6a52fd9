"""Changes to a RedisStore's keys behind its back, by the store's documented layout
(see sessionactors/stores/_redis.py): damage that the store must survive."""

import base64
import contextlib
import zlib
from collections.abc import AsyncIterator
from typing import Any

import coredis
from coredis.connection import TCPLocation


def _session_key(prefix: str, raw: bytes, part: str) -> str:
    encoded = base64.urlsafe_b64encode(raw).rstrip(b"=").decode()
    return f"{prefix}:{{g{zlib.crc32(raw) % 1024}}}:s:{encoded}:{part}"


async def rot_name(url: str, prefix: str, name: str, raw: bytes) -> list[str]:
    """Rename session ``name`` to the bytes ``raw`` (not UTF-8) in every key and index
    that holds it, as damage (or a writer of another version) would; the keys that now
    hold it."""
    old, new = name.encode(), raw
    async with coredis.Redis.from_url(url, decode_responses=False) as client:
        moved = []
        for part in ("meta", "info", "log", "lease"):
            if await client.exists([_session_key(prefix, old, part)]):
                target = _session_key(prefix, new, part)
                await client.rename(_session_key(prefix, old, part), target)
                moved.append(target)
        old_set = f"{prefix}:{{g{zlib.crc32(old) % 1024}}}:sessions"
        new_set = f"{prefix}:{{g{zlib.crc32(new) % 1024}}}:sessions"
        encoded = base64.urlsafe_b64encode
        assert await client.srem(old_set, [encoded(old).rstrip(b"=")]) == 1
        await client.sadd(new_set, [encoded(new).rstrip(b"=")])
        activity = f"{prefix}:activity"
        score = await client.zscore(activity, old.hex())
        assert score is not None
        await client.zrem(activity, [old.hex()])
        await client.zadd(activity, {new.hex(): score})
        return moved


async def keys_of(url: str, prefix: str, raw: bytes) -> list[bytes]:
    """The keys under ``prefix`` that name the session whose name's bytes are ``raw``,
    and its places in the indexes (as ``b"sessions"``, ``b"activity"``)."""
    encoded = base64.urlsafe_b64encode(raw).rstrip(b"=")
    async with coredis.Redis.from_url(url, decode_responses=False) as client:
        found = [key async for key in client.scan_iter(match=f"{prefix}:*", count=1000)]
        out = [key for key in found if b":s:" + encoded + b":" in key]
        sessions = f"{prefix}:{{g{zlib.crc32(raw) % 1024}}}:sessions"
        if await client.sismember(sessions, encoded):
            out.append(b"sessions")
        if await client.zscore(f"{prefix}:activity", raw.hex()) is not None:
            out.append(b"activity")
        return out


async def drop_prefix(url: str, prefix: str) -> None:
    """Remove every key under ``prefix``."""
    async with coredis.Redis.from_url(url) as client:
        keys = [key async for key in client.scan_iter(match=f"{prefix}:*", count=1000)]
        if keys:
            await client.unlink(keys)


def session_key(prefix: str, name: str, part: str) -> str:
    """The key of session ``name`` that holds ``part`` ("meta", "log", "ev", ...)."""
    return _session_key(prefix, name.encode(), part)


def group_key(prefix: str, name: str, part: str) -> str:
    """The key of ``name``'s key group that holds ``part`` ("shard", "fence", "sessions")."""
    return f"{prefix}:{{g{zlib.crc32(name.encode()) % 1024}}}:{part}"


@contextlib.asynccontextmanager
async def admin_client(url: str) -> AsyncIterator[Any]:
    """A client of the server a store's URL names: one server, a Redis Cluster, or the
    master that a Sentinel knows."""
    if url.startswith("redis+cluster://"):
        node = url.removeprefix("redis+cluster://").split(",")[0]
        host, _, port = node.rpartition(":")
        async with coredis.RedisCluster(host, int(port)) as cluster:
            yield cluster
    elif url.startswith("redis+sentinel://"):
        where, _, service = url.removeprefix("redis+sentinel://").partition("/")
        host, _, port = where.rpartition(":")
        async with coredis.Sentinel([TCPLocation(host, int(port))]) as sentinel:
            address = await sentinel.discover_primary(service.split("/")[0])
        async with coredis.Redis(*address) as client:
            yield client
    else:
        async with coredis.Redis.from_url(url) as client:
            yield client


async def replace_with_list(url: str, key: str) -> None:
    """Put a list at ``key`` in place of what the store keeps there, as another
    application writing under the store's prefix would."""
    async with admin_client(url) as client:
        await client.delete([key])
        await client.rpush(key, ["another application's"])


def worker_key(prefix: str, worker: str, part: str) -> str:
    """The key of worker ``worker`` that holds ``part`` ("inbox", "alive")."""
    raw = worker.encode()
    encoded = base64.urlsafe_b64encode(raw).rstrip(b"=").decode()
    return f"{prefix}:{{g{zlib.crc32(raw) % 1024}}}:w:{encoded}:{part}"
