"""``RedisStore``: sessions kept in Redis, shared by many worker processes.

Layout (every key starts with ``prefix``; ``<n>`` is the session name as
unpadded base64url of its UTF-8 bytes, so no character of a name ever
reaches a key, a pattern or a script unescaped; ``<g>`` is the name's key
group, ``crc32(UTF-8 name) % 1024``)::

    <prefix>:{g<g>}:fence       fencing counter of the sessions of group <g> (INCR)
    <prefix>:{g<g>}:sessions    set of the stored ``<n>`` of group <g> (for list_sessions)
    <prefix>:{g<g>}:s:<n>:meta  hash: snap (snapshot bytes), seq (its seq),
                                last (highest seq appended), trimmed (highest seq trimmed)
    <prefix>:{g<g>}:s:<n>:info  the info blob
    <prefix>:{g<g>}:s:<n>:log   the journal, a stream whose entry ids are ``<seq>-0``
    <prefix>:{g<g>}:s:<n>:lease hash: owner, fence, epoch (of the shard it was taken under)
    <prefix>:{g<g>}:s:<n>:watch set while a worker other than the owner subscribes to the
                                session (expiring; see the multi-worker transport)
    <prefix>:{g<g>}:shard       the lease of shard <g> (every session of group <g>):
                                hash: owner, epoch, n (sessions held); expires (PEXPIRE)
    <prefix>:activity           sorted set: the UTF-8 bytes of every stored name in hex
                                (which sorts as the names do), scored by its info's
                                activity time (for list_page; see _index_activity)

Leases are held by shard, the key groups: a worker that claims a session takes
its shard's lease if it is free (its epoch: that claim's fence), or shares it if
it is the worker's already; a session's lease counts only while the shard's lease
it was taken under lives, and a worker renews its shards in one pipeline
(``renew_many``) whatever the number of its sessions. The shard goes with its last
session's release; a dead worker's shards are free once their leases expire.

``{g<g>}`` is a Redis Cluster hash tag: every key a script touches shares its
session's group, so it sits in one hash slot, and the groups spread the
sessions over the cluster's masters (the activity index is one key: on one
server the write scripts update it in the same step, on a cluster single-key
commands after each script do). Every write is one Lua script, so
it is atomic and, when it carries a fencing token, checks that token in the
same step, with the lease's owner and the journal's last seq as the writer
last saw them (a lease claimed through this store object): a stale owner's
write is refused even after redis lost data and issued its token again.
Fencing tokens come from the group's counter, which is never deleted, and are
at least the server's clock in microseconds: they strictly increase for every
session, across claims, releases, deletes and restores from an older backup,
and no per-session key outlives a delete.

The store speaks to Redis 6.2 or later (``XTRIM MINID`` and exclusive
``XRANGE`` ranges): one server, a Redis Cluster or a Sentinel's master (see
``_redis_connect`` for the URLs); it checks the server's persistence on every
connection its client opens, before anything goes over it.
"""

from __future__ import annotations

import base64
import logging
import math
import os
import zlib
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Final, TypeVar

import anyio
import attrs
import coredis
import coredis.exceptions
import trio
from coredis.commands import Script

from .._codec import MAX_SEQ
from .._errors import (
    Advice,
    AdviceKind,
    LeasesUnrenewedError,
    SnapshotCorruptError,
    StoreConfigurationError,
    StoreError,
    StoreNotDurableError,
    StoreNotReplicatedError,
    advised,
)
from .._listing import after_not_found, info_activity
from .._names import name_bytes, redact, stored_name
from .._router import Router, RouterHost
from ._base import JournalEntry, Lease, StoredSession
from ._memory import (
    _check_entries,
    _check_snapshot_seqs,
    _check_stored_entries,
    _check_stored_seq,
    _check_ttl,
    _exists_error,
    _fenced_out_error,
    _not_found_error,
    _stored_corrupt,
)
from ._redis_connect import (
    USE_CLUSTER_URL,
    Client,
    ServerNotDurable,
    Target,
    check_deployment,
    check_persistence,
    open_client,
)

__all__ = ["RedisStore"]

_T = TypeVar("_T")

log = logging.getLogger("sessionactors")

# Seqs and fences travel through Lua, whose numbers are doubles: keep them exact
# (the codec's bound on every seq is the same).
_MAX_SEQ: Final = MAX_SEQ
_MGET_CHUNK: Final = 500
#: Key groups (hash tags): a session's keys share its group's slot in a Redis Cluster.
_GROUPS: Final = 1024

# Status codes returned by the write scripts.
_OK: Final = 0
_NOT_FOUND: Final = 1
_FENCED: Final = 2
_SEQ_CONFLICT: Final = 3
_OLDER_SNAPSHOT: Final = 4
_MOVED_ON: Final = 5
_DAMAGED: Final = 6  # a seq field of the meta hash is missing or not a number

#: What each seq field of a session's meta hash holds, as errors name it.
_SEQ_FIELDS: Final = {
    b"seq": "the snapshot's seq",
    b"last": "the journal's last seq",
    b"trimmed": "the journal's trimmed seq",
}


def _check_types(*kept: tuple[int, str]) -> str:
    """Lua that refuses the script before it writes anything if one of its keys
    (``KEYS[i]``, for each ``(i, type)`` in ``kept``; one not given is skipped) holds
    another type of value than the store keeps there: with the error redis gives a
    command on such a key (WRONGTYPE), which ``RedisStore._run`` translates, naming the
    session and the key. Without it a script that met such a key after its first write
    would stop there, with that write made (scripts are not rolled back)."""
    tests = " or ".join(f"wrong({i}, '{kind}')" for i, kind in kept)
    return f"""
local function wrong(i, kind)
  if not KEYS[i] then return false end
  local found = redis.call('TYPE', KEYS[i]).ok
  return found ~= kind and found ~= 'none'
end
if {tests} then
  return redis.error_reply('WRONGTYPE Operation against a key holding the wrong kind of value')
end
"""


def _check_fence(owner: int) -> str:
    """A fenced write passes when the lease exists and holds ``fence`` (ARGV[1]) and,
    when given, the owner (ARGV[owner]); when its shard's lease (KEYS[5]) is unexpired
    and still the one the session's lease was taken under (the same owner and epoch);
    and when given, the journal's
    last seq is one of the writer's (ARGV[owner + 1], or ARGV[owner + 2]: the last
    append whose outcome it did not hear). Replies {2, current fence or nil (no lease
    at all)}, {2, fence, 'shard'} (the shard's lease ended or changed hands), or
    {5, last seq}: another owner wrote since (the store may have lost data and
    issued a fence again), so the writer's view is stale."""
    return f"""
if ARGV[1] ~= '' then
  local lease = redis.call('HMGET', KEYS[4], 'fence', 'owner', 'epoch')
  if lease[1] ~= ARGV[1] then return {{2, lease[1]}} end
  if ARGV[{owner}] ~= '' and lease[2] ~= ARGV[{owner}] then return {{2, lease[1]}} end
  local shard = redis.call('HMGET', KEYS[5], 'owner', 'epoch')
  if shard[1] ~= lease[2] or shard[2] ~= lease[3] then return {{2, lease[1], 'shard'}} end
  if ARGV[{owner + 1}] ~= '' then
    local last = redis.call('HGET', KEYS[1], 'last')
    if last ~= ARGV[{owner + 1}] and last ~= ARGV[{owner + 2}] then return {{5, last}} end
  end
end
"""


# A write that succeeds also puts the session in the listing order in the same step
# when the store gets the activity index as its last key (one server: no slots to
# keep apart); on a cluster that index sits in another slot and is written after.
def _list_in_script(key: int, member: int, score: int) -> str:
    return f"""
if KEYS[{key}] then redis.call('ZADD', KEYS[{key}], ARGV[{score}], ARGV[{member}]) end
"""


# KEYS: meta, info, log, index[, activity].
# ARGV: snapshot, info, encoded name, listing member, its score.
_CREATE: Final = Script[bytes](
    script=_check_types((4, "set"), (5, "zset"))
    + """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('DEL', KEYS[3])
redis.call('HSET', KEYS[1], 'snap', ARGV[1], 'seq', '0', 'last', '0', 'trimmed', '0')
redis.call('SET', KEYS[2], ARGV[2])
redis.call('SADD', KEYS[4], ARGV[3])
"""
    + _list_in_script(5, 4, 5)
    + """
return 1
"""
)


def _append_script(done: str = "return {0}", after: int = 0) -> str:
    """The append script; ``done`` ends it once it has written, with the ``after``
    arguments that follow the entries."""
    return (
        _check_types((1, "hash"), (3, "stream"), (6, "zset"))
        + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {1} end
"""
        + _check_fence(3)
        + f"""
local last = #ARGV - {after}
if last >= 8 then
  local m = redis.call('HMGET', KEYS[1], 'last', 'seq')
  local l, s = tonumber(m[1]), tonumber(m[2])
  if not l then return {{6, 'last', m[1] or ''}} end
  if not s then return {{6, 'seq', m[2] or ''}} end
  local floor = math.max(l, s)
  if tonumber(ARGV[8]) <= floor then return {{3, floor}} end
  for i = 8, last, 2 do
    redis.call('XADD', KEYS[3], ARGV[i] .. '-0', 'd', ARGV[i + 1])
  end
  redis.call('HSET', KEYS[1], 'last', ARGV[last - 1])
end
redis.call('SET', KEYS[2], ARGV[2])
"""
        + _list_in_script(6, 6, 7)
        + "\n"
        + done
        + "\n"
    )


# KEYS: meta, info, log, lease, shard[, activity].
# ARGV: fence or '', info, owner or '', last seq expected or '' (twice), listing member,
# its score, then seq, data pairs.
_APPEND: Final = Script[bytes](script=_append_script())
# The same, then a message published: ARGV ends with its channel and the message; the
# number of subscribers that got it is returned second, 0 if the publish was refused
# (the write stands: see RedisTransport.append_and_send).
_APPEND_AND_PUBLISH: Final = Script[bytes](
    script=_append_script(
        """
local heard = redis.pcall('PUBLISH', ARGV[#ARGV - 1], ARGV[#ARGV])
if type(heard) ~= 'number' then heard = 0 end
return {0, heard}""",
        2,
    )
)

# KEYS: meta, info, log, lease, shard[, activity].
# ARGV: fence or '', info, snapshot, seq, trim_upto, first id kept ('<trim_upto + 1>-0'),
# owner or '', last seq expected or '' (twice), listing member, its score.
_WRITE_SNAPSHOT: Final = Script[bytes](
    script=_check_types((1, "hash"), (3, "stream"), (6, "zset"))
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {1} end
"""
    + _check_fence(7)
    + """
local m = redis.call('HMGET', KEYS[1], 'seq', 'trimmed')
if not tonumber(m[1]) then return {6, 'seq', m[1] or ''} end
if not tonumber(m[2]) then return {6, 'trimmed', m[2] or ''} end
if tonumber(ARGV[4]) < tonumber(m[1]) then return {4, m[1]} end
redis.call('HSET', KEYS[1], 'snap', ARGV[3], 'seq', ARGV[4])
if tonumber(ARGV[5]) > tonumber(m[2]) then
  redis.call('XTRIM', KEYS[3], 'MINID', ARGV[6])
  redis.call('HSET', KEYS[1], 'trimmed', ARGV[5])
end
redis.call('SET', KEYS[2], ARGV[2])
"""
    + _list_in_script(6, 10, 11)
    + """
return {0}
"""
)

# KEYS: meta, log, info.  Returns false, or {snapshot, seq, entries after seq, info}
# (no entries if seq is not a number: the caller refuses it; info '' if there is none,
# or it is damaged, a key of another type).
_LOAD: Final = Script[bytes](
    script="""
local m = redis.call('HMGET', KEYS[1], 'snap', 'seq')
if not m[1] then return false end
local info = redis.pcall('GET', KEYS[3])
if type(info) ~= 'string' then info = '' end
if not string.match(m[2] or '', '^%d+$') then return {m[1], m[2] or '', {}, info} end
return {m[1], m[2], redis.call('XRANGE', KEYS[2], '(' .. m[2] .. '-0', '+'), info}
"""
)

# KEYS: meta, log.  ARGV: first id ('(<after>-0' or '-').
# Returns false, or {trimmed ('' if the meta hash lost it: the caller refuses it), entries}.
_READ_JOURNAL: Final = Script[bytes](
    script="""
local t = redis.call('HGET', KEYS[1], 'trimmed')
if not t then
  if redis.call('EXISTS', KEYS[1]) == 0 then return false end
  t = ''
end
return {t, redis.call('XRANGE', KEYS[2], ARGV[1], '+')}
"""
)

# KEYS: meta, log.  ARGV: first id ('(<after>-0' or '-'), most entries, most bytes.
# Returns false, or {trimmed (or ''), entries}: the first entries of the journal from the first
# id on, at most the most entries, and none after the one whose data brings theirs to
# the most bytes. They are read a few at a time, so the script holds no more than that
# either, however large the entries past the bound are.
_READ_JOURNAL_PAGE: Final = Script[bytes](
    script="""
local t = redis.call('HGET', KEYS[1], 'trimmed')
if not t then
  if redis.call('EXISTS', KEYS[1]) == 0 then return false end
  t = ''
end
local most, bytes = tonumber(ARGV[2]), tonumber(ARGV[3])
local page, size, first = {}, 0, ARGV[1]
while #page < most do
  local want = math.min(most - #page, 16)
  local batch = redis.call('XRANGE', KEYS[2], first, '+', 'COUNT', want)
  for _, entry in ipairs(batch) do
    page[#page + 1] = entry
    local data = entry[2][2]
    if type(data) == 'string' then size = size + #data end
    if size >= bytes then return {t, page} end
  end
  if #batch < want then break end
  first = '(' .. batch[#batch][1]
end
return {t, page}
"""
)

# KEYS: meta, info, log, lease, shard, index[, activity].  ARGV: encoded name, listing
# member.
# (A session's own keys are deleted whatever they hold: deleting is the way out of one
# that is damaged; its lease is read first.)
_DELETE: Final = Script[bytes](
    script=_check_types((4, "hash"), (5, "hash"), (6, "set"), (7, "zset"))
    + """
local existed = redis.call('EXISTS', KEYS[1])
local lease = redis.call('HMGET', KEYS[4], 'owner', 'epoch')
local shard = redis.call('HMGET', KEYS[5], 'owner', 'epoch')
if lease[1] and lease[1] == shard[1] and lease[2] == shard[2] then
  if redis.call('HINCRBY', KEYS[5], 'n', -1) <= 0 then redis.call('DEL', KEYS[5]) end
end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4])
redis.call('SREM', KEYS[6], ARGV[1])
if KEYS[7] then redis.call('ZREM', KEYS[7], ARGV[2]) end
return existed
"""
)

# Leases are held by shard: a session's lease (KEYS[1]: owner, fence, epoch) counts
# while its shard's lease (KEYS[4]: owner, epoch, n = the sessions it holds; expiring)
# is the one it was taken under. A worker renews its shards, not its sessions.

# KEYS: lease, fence counter, meta, shard, watch.  ARGV: owner, ttl in ms.
# Returns false (the shard is another owner's), or {the new fence, the journal's last
# seq, the shard's epoch, whether another worker subscribes to the session}. A fence
# is above every one issued before, also after the counter went back with lost data
# (a restore from an older backup, a lagging replica): it is at least the server's
# clock in microseconds. A shard taken anew gets its first session's fence as its epoch.
_CLAIM: Final = Script[bytes](
    script=_check_types((1, "hash"), (2, "string"), (3, "hash"), (4, "hash"))
    + """
local shard = redis.call('HMGET', KEYS[4], 'owner', 'epoch')
if shard[1] and shard[1] ~= ARGV[1] then return false end
local fence = redis.call('INCR', KEYS[2])
local now = redis.call('TIME')
local floor = tonumber(now[1]) * 1000000 + tonumber(now[2])
if fence < floor then fence = floor end
fence = string.format('%d', fence)
redis.call('SET', KEYS[2], fence)
local epoch = shard[2]
if not shard[1] then
  epoch = fence
  redis.call('DEL', KEYS[4])
  redis.call('HSET', KEYS[4], 'owner', ARGV[1], 'epoch', epoch, 'n', 0)
end
local lease = redis.call('HMGET', KEYS[1], 'owner', 'epoch')
if lease[1] ~= ARGV[1] or lease[2] ~= epoch then redis.call('HINCRBY', KEYS[4], 'n', 1) end
redis.call('PEXPIRE', KEYS[4], ARGV[2])
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'fence', fence, 'epoch', epoch)
return {fence, redis.call('HGET', KEYS[3], 'last') or '0', epoch, redis.call('EXISTS', KEYS[5])}
"""
)

# KEYS: lease, shard.  ARGV: owner, fence, ttl in ms.
_RENEW: Final = Script[bytes](
    script="""
local v = redis.call('HMGET', KEYS[1], 'owner', 'fence', 'epoch')
if v[1] ~= ARGV[1] or v[2] ~= ARGV[2] then return 0 end
local shard = redis.call('HMGET', KEYS[2], 'owner', 'epoch')
if shard[1] ~= v[1] or shard[2] ~= v[3] then return 0 end
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return 1
"""
)

# KEYS: shard.  ARGV: owner, epoch, ttl in ms.  Whether the shard is still held.
_RENEW_SHARD: Final = Script[bytes](
    script="""
local shard = redis.call('HMGET', KEYS[1], 'owner', 'epoch')
if shard[1] ~= ARGV[1] or shard[2] ~= ARGV[2] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""
)

# KEYS: lease, shard.  ARGV: owner, fence.  The shard goes with its last session.
_RELEASE: Final = Script[bytes](
    script=_check_types((1, "hash"), (2, "hash"))
    + """
local v = redis.call('HMGET', KEYS[1], 'owner', 'fence', 'epoch')
if v[1] ~= ARGV[1] or v[2] ~= ARGV[2] then return 0 end
redis.call('DEL', KEYS[1])
local shard = redis.call('HMGET', KEYS[2], 'owner', 'epoch')
if shard[1] == v[1] and shard[2] == v[3] then
  if redis.call('HINCRBY', KEYS[2], 'n', -1) <= 0 then redis.call('DEL', KEYS[2]) end
end
return 1
"""
)

# What a lost or refused connection can raise from inside coredis.
_TRANSPORT_ERRORS: Final = (
    coredis.exceptions.RedisError,
    OSError,
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    anyio.EndOfStream,
)


# What a retry cannot fix: the store's user lacks a permission, the server lacks a
# command (renamed, disabled, too old), keys of one call sit in several cluster slots.
_CONFIGURATION_ERRORS: Final = (
    coredis.exceptions.AuthorizationError,
    coredis.exceptions.AuthenticationError,
    coredis.exceptions.ClusterCrossSlotError,
    coredis.exceptions.UnknownCommandError,
)
# (lower case; coredis drops the error code of some replies, and a command refused
# inside a script comes back as the script's error, worded by the server)
_CONFIGURATION_CODES: Final = (
    "noperm",
    "no permissions",
    "can't run this command",
    "can't access",
    "crossslot",
    "noauth",
    "wrongpass",
    "unknown command",
)


class _Default(str):
    """The default of an argument, told apart (by identity) from the same text given."""

    __slots__ = ()


#: The key prefix of a RedisStore given none (in prefix= or the URL's ?prefix=): a
#: prefix= left out, unlike prefix="sessionactors", defers to the URL's.
_DEFAULT_PREFIX: Final = _Default("sessionactors")
#: Seconds a call to redis may take before it fails with StoreError (RedisStore's timeout).
DEFAULT_TIMEOUT: Final = 5.0


#: What to do when the server refuses the store's login, or has no database of its number.
_LOGIN_FIX: Final = "check the user name and password in the store's URL"
_DATABASE_FIX: Final = (
    "the server has no database of the number in the store's URL (its 'databases' "
    "setting says how many it has): check the database number"
)
_WRONG_TYPE_FIX: Final = (
    "a key under the store's prefix holds another type of value than the store keeps "
    "there (another application's keys under the same prefix, or keys changed behind the "
    "store's back): give the store a prefix of its own (RedisStore(url, prefix=...), or "
    "?prefix= in the command line's URL), or remove those keys"
)
#: A session's keys (by their last part): the type of value the store keeps there, what
#: it holds, and whether it holds part of the conversation (the snapshot and journal;
#: the store writes the others again).
_SESSION_KEYS: Final = {
    "meta": ("hash", "its snapshot", True),
    "log": ("stream", "its journal", True),
    "info": ("string", "its summary for listings", False),
    "lease": ("hash", "its lease", False),
    "watch": ("string", "whether other workers subscribe to it", False),
    "ev": ("stream", "its events for subscribers on other workers", False),
}
#: A key group's keys, which its sessions share: the type kept there, what it holds.
_GROUP_KEYS: Final = {
    "shard": ("hash", "the lease of a key group's sessions"),
    "fence": ("string", "the fencing counter of a key group"),
    "sessions": ("set", "the index of a key group's sessions"),
}


@attrs.frozen
class _WrongType:
    """A key that holds another type of value (``found``) than the store keeps there
    (``kept``, ``what`` it holds); ``session``: the session whose own key it is (None:
    sessions share it), and whether it holds part of its conversation."""

    key: str
    session: str | None
    found: str
    kept: str
    what: str
    conversation: bool = False

    def told(self) -> str:
        return (
            f"{self.key!r} holds a {self.found}, not the {self.kept} the store keeps there"
            f" ({self.what})"
        )


def _damaged_session(damage: Sequence[_WrongType]) -> SnapshotCorruptError:
    """The error of a session some of whose own keys (``damage``) hold another type of
    value: the session's, not the store's (every other session goes on)."""
    session_id = damage[0].session
    assert session_id is not None
    told = (
        f"the store's record of session {session_id!r} is corrupt: "
        + "; ".join(f"its key {wrong.told()}" for wrong in damage)
        + ". It was changed behind sessionactors' back (another application's keys under"
        " the store's prefix?): "
    )
    if any(wrong.conversation for wrong in damage):
        return advised(
            SnapshotCorruptError,
            told + "restore the session from a backup, or delete it with ",
            Advice(kind=AdviceKind.DELETE),
            session_id=session_id,
        )
    keys = " ".join(repr(wrong.key) for wrong in damage)
    that = "that key" if len(damage) == 1 else "those keys"
    return advised(
        SnapshotCorruptError,
        f"{told}remove {that} (redis-cli DEL {keys}): no part of the conversation is"
        " there, and the store writes it again",
        session_id=session_id,
    )


def _configuration_problem(exc: BaseException, client: Client | None) -> str | None:
    """What to do about ``exc`` if no retry can fix it (None: a retry may)."""
    if isinstance(exc, _Unavailable) and exc.__cause__ is not None:
        exc = exc.__cause__  # the client could not be opened: why
    message = str(exc).lower()
    if isinstance(exc, coredis.exceptions.AuthenticationError) or any(
        code in message for code in ("noauth", "wrongpass", "invalid username-password")
    ):
        return _LOGIN_FIX
    if "db index is out of range" in message:
        return _DATABASE_FIX
    if "wrongtype" in message or "wrong kind of value" in message:
        return _WRONG_TYPE_FIX
    if isinstance(exc, coredis.exceptions.AskError) and not isinstance(
        client, coredis.RedisCluster
    ):
        # MOVED or ASK: a client for one server reached a cluster node
        return f"the server is a node of a Redis Cluster: {USE_CLUSTER_URL}"
    # an error raised by a command inside a script comes back as the script's error
    if isinstance(exc, _CONFIGURATION_ERRORS) or (
        isinstance(exc, coredis.exceptions.ResponseError)
        and any(code in str(exc).lower() for code in _CONFIGURATION_CODES)
    ):
        return (
            "grant the store's redis user the commands and keys under its prefix "
            "(scripts, streams, blocking reads), and on a cluster keep one session's "
            "keys in one slot"
        )
    return None


def _wrong_type(exc: BaseException | None) -> bool:
    """Whether ``exc`` is redis refusing a key that holds another type of value."""
    message = str(exc).lower()
    return exc is not None and ("wrongtype" in message or "wrong kind of value" in message)


def _encode_name(session_id: str) -> str:
    raw = name_bytes(session_id)  # (a damaged name's own bytes: see _decode_name)
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def _utf8(text: str) -> bool:
    """Whether UTF-8 can encode ``text`` (no lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _group(name: str) -> int:
    """The key group of a session (or worker) name: its keys' hash tag."""
    return zlib.crc32(name_bytes(name)) % _GROUPS


def _decode_name(encoded: bytes) -> str | None:
    """The session named by a member of a group's index; None for one that is not
    base64 (the store never writes one). Bytes that are not UTF-8 (damage, or a writer
    of another version) give a name that listings leave out, with a warning, and that
    ``delete`` takes back to those bytes (see ``damaged_name``)."""
    try:
        raw = base64.urlsafe_b64decode(encoded + b"=" * (-len(encoded) % 4))
    except ValueError:
        return None
    return stored_name(raw)


def _member_name(member: bytes) -> str | None:
    """The session named by a member of the listing order (see ``_listing``); None for a
    member that is not hex (the store never writes one: damage). Bytes that are not
    UTF-8 give a damaged name, as in ``_decode_name``."""
    try:
        return stored_name(bytes.fromhex(bytes(member).decode("ascii")))
    except ValueError:
        return None


async def _info_reply(reply: Awaitable[Any]) -> bytes | None:
    """A session's info read by a pipeline's GET: b"" (unreadable, so listed as failed)
    if its key holds another type than a string."""
    try:
        info: bytes | None = await reply
    except coredis.exceptions.WrongTypeError:
        return b""
    return info


_CLIENT_FILES: Final = os.path.dirname(coredis.__file__) + os.sep


def _raised_by_client(exc: BaseException) -> bool:
    """Whether ``exc`` was raised inside coredis (not by the store's own code)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_filename.startswith(_CLIENT_FILES)


def _pipeline(client: Client, *, raise_on_error: bool = True) -> Any:
    """A pipeline without a transaction (on a cluster, one per master it reaches);
    without ``raise_on_error``, each reply raises its own error when awaited."""
    if isinstance(client, coredis.RedisCluster | coredis.Redis):
        return client.pipeline(transaction=False, raise_on_error=raise_on_error)
    raise TypeError(f"a redis store needs a coredis.Redis or RedisCluster, not {client!r}")


def _ttl_ms(ttl: float) -> str:
    _check_ttl(ttl)
    return str(max(1, math.ceil(ttl * 1000)))


def _listing(session_id: str, info: bytes | None) -> list[str]:
    """The session's member in the listing order (the UTF-8 bytes of its name in hex,
    which sort as the names do) and its score, the activity time of ``info``."""
    return [name_bytes(session_id).hex(), "" if info is None else str(info_activity(info))]


def _fence_arg(fence: int | None) -> str:
    return "" if fence is None else str(fence)


def _position_args(held: _Held | None) -> list[str | bytes]:
    """The owner and the journal positions a fenced write expects (empty: no check)."""
    if held is None:
        return ["", "", ""]
    return [held.owner, held.last, held.unsure]


def _check_max_seq(session_id: str, seq: int) -> None:
    if seq > _MAX_SEQ:
        raise StoreError(
            f"session {session_id!r}: seq {seq} is above 2**53 - 1, the largest the redis "
            "store keeps exactly; keep seqs below it (nothing was written)",
            session_id=session_id,
        )


@attrs.define
class _Held:
    """A lease claimed through this store: its shard's epoch, the journal's last seq as
    its holder knows it, and the last seq of an append whose outcome it did not hear (or "")."""

    fence: int
    owner: str
    last: str
    epoch: str = ""  # the epoch of the shard the lease was taken under
    unsure: str = ""
    watched: bool = False  # another worker subscribed when it was claimed (not yet taken)


def _check_status(
    reply: Any, session_id: str, fence: int | None, held: _Held | None = None
) -> None:
    """Raise the error a write script's status reply stands for (``held``: the lease
    the write was made under, as this store knew it)."""
    status = int(reply[0])
    if status == _OK:
        return
    if status == _NOT_FOUND:
        raise _not_found_error(session_id)
    if status == _DAMAGED:  # (nothing written)
        what = _SEQ_FIELDS[bytes(reply[1])]
        _check_stored_seq(session_id, _stored_int(reply[2]), what)  # raises, worded as reads
        raise _stored_corrupt(session_id, f"{what} is {bytes(reply[2])[:40]!r}")
    if status == _MOVED_ON and fence is not None:
        last = _stored_int(reply[1] if len(reply) > 1 else None)
        if held is not None and isinstance(last, int) and last < int(held.last or 0):
            raise _fenced_out_error(session_id, fence, f"journal:{last}:{held.last}")
        raise _fenced_out_error(
            session_id,
            fence,
            f"the journal's last seq is {last!r}, not the one this owner wrote last",
        )
    if status == _FENCED and fence is not None:
        current = reply[1] if len(reply) > 1 else None
        if len(reply) > 2:
            problem = "the lease of its shard lapsed unrenewed or changed hands"
        elif current is None:
            problem = "no_lease"
        elif fence > int(current):
            problem = f"older:{int(current)}"
        else:
            problem = f"claimed:{int(current)}"
        raise _fenced_out_error(session_id, fence, problem)
    raise StoreError(
        f"session {session_id!r}: unexpected reply {reply!r} from redis; "
        "check that nothing else writes under this store's prefix",
        session_id=session_id,
    )


def _renewing(count: int) -> tuple[str, str]:
    """What a renewal of ``count`` sessions' leases does, and to what (as errors say)."""
    if count == 1:
        return "renew the lease of", "1 session"
    return "renew the leases of", f"{count} sessions"


def _stored_int(raw: Any) -> Any:
    """An integer read back from redis (its decimal digits), or ``raw`` as it is, for
    the range check to refuse (None for the scripts' '': a field the hash lost)."""
    if raw == b"":
        return None
    try:
        text = bytes(raw).decode("ascii")
        if text.isdigit() or (text[:1] == "-" and text[1:].isdigit()):
            return int(text)
    except (TypeError, ValueError):
        pass
    return raw


def _entries(session_id: str, reply: Any, after: int) -> list[JournalEntry]:
    """The journal entries of an XRANGE reply (``[[b'<seq>-0', [b'd', data]], ...]``),
    their seqs checked like any value read back from the store."""
    rows = []
    try:
        for eid, fields in reply:
            seq, _, tail = bytes(eid).partition(b"-")
            if tail != b"0" or len(fields) != 2 or bytes(fields[0]) != b"d":
                raise _stored_corrupt(session_id, "a journal entry has a foreign layout")
            rows.append((_stored_int(seq), bytes(fields[1])))
    except (TypeError, ValueError) as exc:
        raise _stored_corrupt(session_id, "a journal entry has a foreign layout") from exc
    return _check_stored_entries(session_id, rows, after)


class _Unavailable(Exception):
    """The client could not be opened."""


@attrs.define(eq=False)
class _Connection:
    """One lazily opened client, owned by a system task of the trio run that opened it."""

    token: trio.lowlevel.TrioToken
    ready: trio.Event = attrs.field(factory=trio.Event)
    stop: trio.Event = attrs.field(factory=trio.Event)
    done: trio.Event = attrs.field(factory=trio.Event)
    client: Client | None = None
    error: BaseException | None = None
    opening: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    calls: int = 0  # the calls running on it
    retired: bool = False  # closed once its last call ends

    def close(self) -> None:
        """Close the client; one still opening (connecting, checking) at once."""
        self.stop.set()
        if not self.ready.is_set():
            self.error = self.error or ConnectionError("given up while it was opening")
            self.opening.cancel()


async def _own_client(conn: _Connection, target: Target, patience: float) -> None:
    # The client's connection pool runs a task group that must be entered and
    # exited by one task: this one, which lives until aclose() or the end of the run.
    try:
        with conn.opening:
            async with open_client(target, patience) as client:
                try:
                    # (its INFO opens the first connection, which checks persistence)
                    await check_deployment(client, target, redact(target.url))
                    if target.cluster:  # every master now, not as the calls reach them
                        await check_persistence(client, target, redact(target.url))
                except ServerNotDurable as exc:
                    conn.error = StoreNotDurableError(str(exc))
                    return
                except (StoreNotDurableError, StoreConfigurationError) as exc:
                    conn.error = exc  # raised as it is to every waiting call
                    return
                conn.client = client
                conn.ready.set()
                await conn.stop.wait()
    except Exception as exc:
        # the client's task group wraps the cause: keep the cause, for the error to name
        while isinstance(exc, ExceptionGroup) and len(exc.exceptions) == 1:
            exc = exc.exceptions[0]
        conn.error = exc
    finally:
        conn.client = None
        conn.ready.set()
        conn.done.set()


@attrs.define(eq=False, repr=False)
class RedisStore:
    """A :class:`~sessionactors.stores.Store` in Redis, for many processes or machines.

    ``url`` names one server (``redis://host:port/db``, ``rediss://`` with TLS,
    ``unix:///path/to/socket``), a Redis Cluster (``redis+cluster://host:port``, more
    nodes separated by commas; ``rediss+cluster://`` with TLS) or the master that
    Sentinel knows as ``service`` (``redis+sentinel://host:port/service[/db]``). A TLS
    URL takes the certificate options in its query (``ssl_ca_certs``, ``ssl_cert_reqs``,
    ``ssl_certfile``, ``ssl_keyfile``, ``ssl_check_hostname``). Every
    key starts with ``prefix`` (or ``?prefix=`` in the URL, as the command line's
    ``--store`` takes it; default ``"sessionactors"``), so several applications can
    share one database. An option named both in the URL and as an argument
    (``prefix``, ``persistence``, ``replicas``, ``replica_timeout``) must name the
    same value there: a ``prefix=`` and a ``?prefix=`` that differ raise
    ``ValueError``, and so do the others, so that neither silently wins. Nothing
    is opened here: the first call connects inside the running trio run, and a call
    after :meth:`aclose` connects again.

    ``persistence`` (or ``?persistence=`` in the URL) is what the store demands of
    the server, checked on every connection the store opens, before anything is
    read or written over it: when it first connects, and again when its client
    reconnects (to a server restarted on the same address, Sentinel's new master,
    a cluster's promoted replica). A server that falls short raises
    :class:`~sessionactors.StoreNotDurableError`, which says how to fix it, until
    it is fixed. ``"always"`` (the default) needs ``appendonly yes`` and ``appendfsync
    always``: every acknowledged write is on disk. ``"everysec"`` also accepts
    ``appendfsync everysec``, which can lose up to about a second of acknowledged
    writes when the machine crashes. ``"volatile"`` checks nothing, for tests and
    caches. On a cluster every master is checked when the store connects.

    ``client`` is an already opened ``coredis.Redis`` or ``coredis.RedisCluster``
    (``decode_responses=False``) to use instead of ``url``, checked on the first
    call only (its connections are its owner's, as is checking them again):
    its owner keeps it open and closes it, not :meth:`aclose`.

    ``replicas`` (or ``?replicas=`` in the URL; default 0: no wait) is the number of
    replicas every write this store acknowledges must reach: creates, journal
    appends, snapshots and deletes each wait (``WAIT``) until that many replicas
    confirm them, for at most ``replica_timeout`` seconds (or ``?replica_timeout=``;
    default 1). Fewer in time raise
    :class:`~sessionactors.StoreNotReplicatedError`: the primary ran the write and
    keeps it, but it is lost if the primary fails before a replica has it, so treat
    its outcome as unsure. A replica confirms what it received, not what it wrote
    to its disk: run the replicas durable too. Leases and the listing order are not
    waited for (fencing does not rest on them surviving).

    ``balance`` (default True): the workers of registries on this store share its
    shards fairly. Each shard (a fixed group of session names) prefers one of the
    live workers; a session that wakes goes to its shard's preferred worker, and
    a worker hands the shards that prefer another worker over to it, a few at a
    time, at their sessions' turn boundaries. When a worker joins, about 1/n of the
    shards move to it; when one leaves, its shards spread over the others. With
    ``balance=False`` a session wakes on the worker that was asked first and stays
    there while it is live. A registry without agents is no worker: it takes no
    shard, and sends a session that is live nowhere to the worker its shard
    prefers, with either setting; while no worker is live, it refuses turns with
    :class:`~sessionactors.WorkerUnreachableError` and serves reads itself.

    ``timeout`` (seconds, default 5) bounds every call to redis, connecting
    included: a call that gets no answer in time (redis stopped, frozen, or
    unreachable) raises :class:`~sessionactors.StoreError`, as a refused
    connection does. Blocking reads wait that long on top of their own wait, and
    writes that wait for replicas ``replica_timeout`` on top.
    Errors a retry cannot fix (a permission the user lacks, scripting or blocking
    commands disabled for it or on the server, ``CROSSSLOT``, a ``redis://`` URL
    that reaches a node of a Redis Cluster, a user name or password the server
    refuses, a database number it does not have, a key that sessions share holding
    another type of value than the store keeps there: the listing order, or a key
    group's index, fencing counter or shard lease) raise
    :class:`~sessionactors.StoreConfigurationError`, which says what to change; a
    multi-worker registry that meets one fails with it rather than retry. A key of
    one session's own that holds another type of value (its snapshot, journal,
    lease or event stream: another application's keys under the same prefix)
    fails only what touches that session, with
    :class:`~sessionactors.SnapshotCorruptError` naming the session and the key
    and saying what to do; every other session goes on, on every worker.

    Needs the ``redis`` extra (coredis).
    """

    #: Several workers share this store: registries hold leases on it by default.
    shared_by_workers = True

    url: str = "redis://127.0.0.1:6379/0"
    prefix: str = attrs.field(default=_DEFAULT_PREFIX, kw_only=True)
    persistence: str | None = attrs.field(default=None, kw_only=True)
    _client: Client | None = attrs.field(default=None, kw_only=True, alias="client")
    timeout: float = attrs.field(default=DEFAULT_TIMEOUT, kw_only=True)
    replicas: int | None = attrs.field(default=None, kw_only=True)
    replica_timeout: float | None = attrs.field(default=None, kw_only=True)
    balance: bool = attrs.field(default=True, kw_only=True)
    _target: Target = attrs.field(init=False)
    _conn: _Connection | None = attrs.field(default=None, init=False)
    _failover_said: bool = attrs.field(default=False, init=False)
    _client_checked: bool = attrs.field(default=False, init=False)
    _held: dict[str, _Held] = attrs.field(factory=dict, init=False)
    _listing_mended: bool = attrs.field(default=False, init=False)

    def __attrs_post_init__(self) -> None:
        url = "redis://localhost" if self._client is not None else self.url
        self._target = Target.parse(url, self.persistence, self.replicas, self.replica_timeout)
        self.persistence = self._target.persistence
        self.replicas = self._target.replicas
        self.replica_timeout = self._target.replica_timeout
        in_url = self._target.prefix
        if self.prefix is _DEFAULT_PREFIX:  # (only a prefix= left out defers to the URL)
            self.prefix = str(_DEFAULT_PREFIX if in_url is None else in_url)
        elif in_url is not None and self.prefix != in_url:
            raise ValueError(
                f"redis url {redact(self.url)!r} names the key prefix {in_url!r} and "
                f"prefix= names {self.prefix!r}; name one"
            )
        if self._client is not None and self._client.decode_responses:
            raise ValueError(
                "the coredis client decodes responses; open it with decode_responses=False"
            )
        if not isinstance(self.prefix, str) or not _utf8(self.prefix):
            raise ValueError(
                f"redis key prefix {self.prefix!r} is not text that UTF-8 can encode, which "
                "every redis key must start with; pass a prefix such as 'sessionactors'"
            )
        if not self.prefix:
            raise ValueError("redis key prefix is empty; pass a prefix such as 'sessionactors'")
        if not (isinstance(self.timeout, int | float) and 0 < self.timeout < math.inf):
            raise ValueError(
                f"redis timeout {self.timeout!r} is not a positive number of seconds; "
                f"pass one such as {DEFAULT_TIMEOUT}"
            )
        if "{" in self.prefix or "}" in self.prefix:
            raise ValueError(
                f"redis key prefix {self.prefix!r} holds a brace, which would change the "
                "keys' Redis Cluster hash tags; pass a prefix without {{ or }}"
            )

    def __repr__(self) -> str:
        where = "client" if self._client is not None else repr(redact(self.url))
        waits = f", replicas={self.replicas}" if self.replicas else ""
        return f"RedisStore({where}, prefix={self.prefix!r}{waits})"

    # -- many workers ----------------------------------------------------------------

    async def open_router(self, host: RouterHost, nursery: trio.Nursery) -> Router:
        """The multi-worker router of a registry on this store: requests and events
        reach a session on whichever worker runs it (``sessionactors.workers``)."""
        from ..workers import open_cluster
        from ._redis_transport import RedisTransport

        return await open_cluster(host, RedisTransport(self), nursery, balance=self.balance)

    # -- keys ----------------------------------------------------------------------

    # Every key is built here, under its group's hash tag: keys that one script
    # touches must share a group (a Redis Cluster runs a script on one slot).

    def _group_key(self, group: int, suffix: str) -> str:
        """The key ``<prefix>:{g<group>}:<suffix>``, shared by a key group."""
        return f"{self.prefix}:{{g{group}}}:{suffix}"

    def _key(self, kind: str, name: str, suffix: str) -> str:
        """The key ``<prefix>:{g<group>}:<kind>:<name, escaped>:<suffix>`` (kind "s": a
        session's, "w": a worker's), in the group of ``name``."""
        return self._group_key(_group(name), f"{kind}:{_encode_name(name)}:{suffix}")

    def _keys(self, session_id: str) -> tuple[str, str, str, str, str]:
        return (
            self._key("s", session_id, "meta"),
            self._key("s", session_id, "info"),
            self._key("s", session_id, "log"),
            self._key("s", session_id, "lease"),
            self._shard_key(_group(session_id)),
        )

    def _shard_key(self, group: int) -> str:
        """The lease of shard ``group``: the sessions of a key group are leased together."""
        return self._group_key(group, "shard")

    def _shard(self, session_id: str) -> int:
        """The shard of ``session_id``: its key group, whose sessions are leased together."""
        return _group(session_id)

    def _watch_key(self, session_id: str) -> str:
        """Set while a worker other than the owner subscribes to ``session_id``."""
        return self._key("s", session_id, "watch")

    def _index_key(self, session_id: str) -> str:
        """The set of the stored sessions of ``session_id``'s group."""
        return self._group_key(_group(session_id), "sessions")

    def _fence_key(self, session_id: str) -> str:
        """The fencing counter of ``session_id``'s group."""
        return self._group_key(_group(session_id), "fence")

    # -- connection ----------------------------------------------------------------

    def _connection(self) -> _Connection | None:
        """The connection of this run (opened on first use); None with a given client."""
        if self._client is not None:
            return None
        token = trio.lowlevel.current_trio_token()
        conn = self._conn
        if conn is None or conn.token is not token or conn.done.is_set():
            conn = self._conn = _Connection(token)
            trio.lowlevel.spawn_system_task(
                _own_client, conn, self._target, self.timeout, name=repr(self)
            )
            self._say_what_a_failover_loses()
        return conn

    def _say_what_a_failover_loses(self) -> None:
        """Behind a Sentinel, whose failovers are its purpose, a store that waits for no
        replica loses the writes a failover leaves behind: said once, as it connects."""
        target = self._target
        if self._failover_said or not target.sentinel or target.replicas:
            return
        if target.persistence == "volatile":  # (tests, caches: losing writes is fine)
            return
        self._failover_said = True
        log.warning(
            "RedisStore at %s waits for no replica (replicas=0): a Sentinel failover "
            "loses the writes the old master acknowledged and had not yet sent to the "
            "replica it promotes; pass replicas=1 (or ?replicas=1) to have each write "
            "wait for a replica (see the Redis how-to)",
            redact(self.url),
        )

    async def _connected(self, conn: _Connection | None) -> Client:
        if conn is None:
            assert self._client is not None
            if not self._client_checked:
                await check_deployment(self._client, self._target, "the given client")
                await check_persistence(self._client, self._target, "the given client")
                self._client_checked = True
            await trio.lowlevel.checkpoint()
            return self._client
        if not conn.ready.is_set():  # (once ready, the call is the schedule point)
            await conn.ready.wait()
        elif conn.client is None:  # no call follows: a schedule point all the same
            await trio.lowlevel.checkpoint()
        if isinstance(conn.error, StoreNotDurableError | StoreConfigurationError):
            raise conn.error
        if conn.client is None:
            raise _Unavailable(str(conn.error)) from conn.error
        return conn.client

    def _reconnect(self, conn: _Connection | None, *, at_once: bool = True) -> None:
        """Have the calls after this one open a new client (if ``conn`` is still the
        current one); the calls running on it end with an error, or (not ``at_once``)
        run to their end, and the client closes after the last."""
        if conn is not None and self._conn is conn:
            self._conn = None
            if at_once or not conn.calls:
                conn.close()
            else:
                conn.retired = True

    async def _run(
        self,
        doing: str,
        session_id: str | None,
        call: Callable[[Client], Awaitable[_T]],
        *,
        block: float = 0.0,
        about: str | None = None,
        streams: Sequence[str] = (),
    ) -> _T:
        """One call, bounded by ``timeout`` (plus ``block``, a blocking read's own wait),
        its errors translated to ``StoreError``, which say what it was ``doing`` to what
        (``about``; by default the session, or "sessions").

        A key that holds another type of value than the store keeps there
        (``WRONGTYPE``) is looked for among the keys of the call's session (for a
        call about the event streams of several sessions, ``streams``, among their
        streams' keys) and the keys they share with other sessions: one of a
        session's own fails the call with that session's ``SnapshotCorruptError``,
        whose ``session_id`` names it (the caller of a call about several goes on
        without it); one that sessions share, or none found, with
        ``StoreConfigurationError``."""
        if about is not None:
            where = about
        else:
            where = f"session {session_id!r}" if session_id is not None else "sessions"
        conn: _Connection | None = None
        try:
            with trio.move_on_after(self.timeout + block):
                conn = self._connection()
                if conn is not None:
                    conn.calls += 1
                return await self._call(conn, doing, session_id, where, call, streams)
        finally:
            if conn is not None:
                conn.calls -= 1
                if conn.retired and not conn.calls:
                    conn.close()
        # No answer in time: the next calls open a new client. Its connections may be
        # half-open (the server gone without a word, a firewall that dropped them),
        # which no reply would ever end.
        self._reconnect(conn)
        raise StoreError(
            f"could not {doing} {where}: redis at {redact(self.url)} did not answer within "
            f"{self.timeout} s (RedisStore(timeout=...)); check that redis-server is running "
            "and not overloaded, then retry",
            session_id=session_id,
        )

    async def _call(
        self,
        conn: _Connection | None,
        doing: str,
        session_id: str | None,
        where: str,
        call: Callable[[Client], Awaitable[_T]],
        streams: Sequence[str],
    ) -> _T:
        """``_run``'s call on ``conn``'s client, its errors translated."""
        client: Client | None = None
        try:
            client = await self._connected(conn)
            return await call(client)
        except (StoreNotDurableError, StoreConfigurationError):
            raise
        except ServerNotDurable as exc:
            # A connection the client opened (to a server restarted, or to another
            # master) failed its check: nothing went over it.
            raise StoreNotDurableError(str(exc), session_id=session_id) from exc
        except coredis.exceptions.ReplicationError as exc:
            if self._target.sentinel:
                # A failover may have made another server the master and left this
                # one without replicas: the next calls ask the Sentinel again (the
                # calls on this client meanwhile run to their end)
                self._reconnect(conn, at_once=False)
            raise StoreNotReplicatedError(
                f"redis at {redact(self.url)} ran the write to {doing} {where}, but "
                f"fewer than {self.replicas} replica(s) confirmed it within "
                f"{self.replica_timeout:g} s (RedisStore(replicas=..., "
                "replica_timeout=...)): it is kept on the primary, and lost if the "
                "primary fails before a replica has it. Read the session before "
                "writing it again, and check that the replicas are connected and "
                "keeping up (INFO replication on the primary)",
                session_id=session_id,
            ) from exc
        except (*_TRANSPORT_ERRORS, _Unavailable) as exc:
            if trio.current_effective_deadline() == -math.inf:
                # cancelled meanwhile (coredis reports a connect it could not
                # finish as a ConnectionError): the cancellation, not an error
                await trio.lowlevel.checkpoint()
            fix = _configuration_problem(exc, client)
            if fix is _WRONG_TYPE_FIX and client is not None:
                fix = await self._wrong_type_fix(client, session_id, streams, exc)
            if fix is not None and (
                isinstance(exc, _Unavailable) or fix in (_LOGIN_FIX, _DATABASE_FIX)
            ):
                # refused as the client connected, or (nothing was asked of the
                # server at connect, as without a persistence check) when the call
                # opened its connection: the call itself never ran
                raise StoreConfigurationError(
                    f"redis at {redact(self.url)} refused the store's connection: "
                    f"{exc}; a retry cannot fix this: {fix}",
                    session_id=session_id,
                ) from exc
            if fix is not None:
                raise StoreConfigurationError(
                    f"redis at {redact(self.url)} refused to {doing} {where}: {exc}; "
                    f"a retry cannot fix this: {fix}",
                    session_id=session_id,
                ) from exc
            if str(exc).startswith("OOM "):
                raise StoreError(
                    f"could not {doing} {where}: redis at {redact(self.url)} is out of "
                    f"memory and refused the call ({exc}); free memory in redis or raise "
                    "its maxmemory, then retry",
                    session_id=session_id,
                ) from exc
            if isinstance(exc, coredis.exceptions.ClusterError):
                # (coredis raises it only once the servers kept redirecting the call)
                raise StoreError(
                    f"could not {doing} {where} in redis at {redact(self.url)}: the "
                    "cluster kept redirecting the call (its hash slot is being migrated "
                    "to another master, or the cluster's layout is changing), so it did "
                    "not run; retry once the resharding or failover is over",
                    session_id=session_id,
                ) from exc
            raise StoreError(
                f"could not {doing} {where} in redis at {redact(self.url)}: {exc}; "
                "check that redis-server is reachable, then retry",
                session_id=session_id,
            ) from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            # coredis failing inside itself: a cluster client merges the answers of
            # every master to a command sent to all of them (the SCRIPT EXISTS before
            # a pipeline of scripts), and one master's lost connection makes the merge
            # fail with a TypeError
            if not _raised_by_client(exc):
                raise
            raise StoreError(
                f"could not {doing} {where} in redis at {redact(self.url)}: the redis "
                f"client failed ({type(exc).__name__}: {exc}), as it does when a node "
                "of a Redis Cluster is down; check that every master is up (or has "
                "been replaced by its replica), then retry",
                session_id=session_id,
            ) from exc
        except RuntimeError as exc:
            # coredis refuses commands once its pool has been closed under them.
            if conn is None or not conn.done.is_set():
                raise
            raise StoreError(
                f"could not {doing} {where}: the redis store was closed meanwhile; retry",
                session_id=session_id,
            ) from exc

    async def _wrong_type_fix(
        self,
        client: Client,
        session_id: str | None,
        streams: Sequence[str],
        exc: BaseException,
    ) -> str | None:
        """What to do about a call that met a key of another type than the store keeps
        there (``exc``), if that key is one that sessions share (or is not found: the
        store's configuration); raise the session's ``SnapshotCorruptError`` if it is
        one of the session's own (of the call's session, or of the ``streams``); None if
        the server did not answer the look (a plain error, to retry: it may be one
        session's key, which must not end the worker)."""
        if session_id is not None:
            damage = await self._wrong_types(client, [session_id], _SESSION_KEYS)
        else:
            damage = await self._wrong_types(client, streams, ("ev",))
        if damage is None:
            return None
        shared = [wrong for wrong in damage if wrong.session is None]
        if shared:
            return (
                f"the key {shared[0].told()} (another application's keys under the same"
                " prefix, or keys changed behind the store's back): give the store a"
                " prefix of its own (RedisStore(url, prefix=...), or ?prefix= in the"
                " command line's URL), or remove that key"
            )
        if damage:
            first = damage[0].session
            raise _damaged_session([wrong for wrong in damage if wrong.session == first]) from exc
        return _WRONG_TYPE_FIX

    async def _wrong_types(
        self, client: Client, names: Sequence[str], parts: Iterable[str]
    ) -> list[_WrongType] | None:
        """The keys of the sessions ``names`` (their ``parts``: see ``_SESSION_KEYS``),
        and those they share with other sessions (their key groups', the listing order;
        with no names, every group's index), that hold another type of value than the
        store keeps there; None if it cannot tell (the server did not answer)."""
        kept: dict[str, tuple[str | None, str, str, bool]] = {}
        for name in names:
            for part in parts:
                kind, what, conversation = _SESSION_KEYS[part]
                kept[self._key("s", name, part)] = (name, kind, what, conversation)
            for part, (kind, what) in _GROUP_KEYS.items():
                kept[self._group_key(_group(name), part)] = (None, kind, what, False)
        if not names:
            kind, what = _GROUP_KEYS["sessions"]
            for group in range(_GROUPS):
                kept[self._group_key(group, "sessions")] = (None, kind, what, False)
        kept[self._activity_key] = (None, "zset", "the listing order of the sessions", False)
        try:
            async with _pipeline(client) as pipe:
                replies = [pipe.type(key) for key in kept]
            types = [await reply for reply in replies]
        except _TRANSPORT_ERRORS:
            return None
        damage = []
        for (key, (session, kind, what, conversation)), found in zip(
            kept.items(), types, strict=True
        ):
            found = found.decode() if isinstance(found, bytes) else str(found)
            if found not in (kind, "none"):
                damage.append(_WrongType(key, session, found, kind, what, conversation))
        return damage

    async def _write(
        self,
        doing: str,
        session_id: str,
        script: Script[bytes],
        keys: Sequence[str],
        args: Sequence[str | bytes],
    ) -> Any:
        """Run a write ``script`` that the caller hears of as done: with ``replicas``,
        its reply waits until that many replicas confirm it (``WAIT``, on the
        connection that wrote), or raises ``StoreNotReplicatedError``."""
        replicas = self._target.replicas
        if not replicas:
            return await self._run(doing, session_id, lambda c: script(keys, args, client=c))
        wait_ms = max(1, math.ceil(self._target.replica_timeout * 1000))

        async def run(client: Client) -> Any:
            with client.ensure_replication(replicas, wait_ms):
                return await script(keys, args, client=client)

        return await self._run(doing, session_id, run, block=self._target.replica_timeout)

    # -- the Store protocol --------------------------------------------------------

    async def create(self, session_id: str, snapshot: bytes, info: bytes) -> None:
        meta, info_key, log, _lease, _shard = self._keys(session_id)
        created: Any = await self._write(
            "create",
            session_id,
            _CREATE,
            [meta, info_key, log, self._index_key(session_id), *self._listing_key()],
            [snapshot, info, _encode_name(session_id), *_listing(session_id, info)],
        )
        if not created:
            raise _exists_error(session_id)
        await self._index_activity(session_id, info)

    async def load(self, session_id: str) -> StoredSession | None:
        meta, info_key, log, _lease, _shard = self._keys(session_id)
        reply: Any = await self._run(
            "load", session_id, lambda c: _LOAD([meta, log, info_key], client=c)
        )
        if reply is None:
            return None
        snapshot, seq, entries, info = reply
        seq = _check_stored_seq(session_id, _stored_int(seq), "the snapshot's seq")
        return StoredSession(
            snapshot=bytes(snapshot),
            snapshot_seq=seq,
            entries=tuple(_entries(session_id, entries, seq)),
            # (b'': none, or damaged, of another type: listed as failed)
            info=bytes(info) or None,
        )

    async def append(
        self,
        session_id: str,
        entries: Sequence[JournalEntry],
        info: bytes,
        *,
        fence: int | None = None,
    ) -> None:
        await self._append(session_id, entries, info, fence, None)

    async def _append(
        self,
        session_id: str,
        entries: Sequence[JournalEntry],
        info: bytes,
        fence: int | None,
        message: tuple[bytes, bytes] | None,
    ) -> int:
        """Append, then publish ``message`` (channel, data) if given (on one server,
        without replicas to wait for); how many subscribers got it."""
        # The order within the batch is checked here; the script checks it against the store.
        _check_max_seq(session_id, _check_entries(session_id, entries, 0))
        held = self._holder(session_id, fence)
        args: list[str | bytes] = [
            _fence_arg(fence),
            info,
            *_position_args(held),
            *_listing(session_id, info),
        ]
        for entry in entries:
            args += [str(entry.seq), entry.data]
        script = _APPEND
        if message is not None:
            assert self._publishes_on_append
            args += message
            script = _APPEND_AND_PUBLISH
        try:
            keys = [*self._keys(session_id), *self._listing_key()]
            reply: Any = await self._write("append to", session_id, script, keys, args)
        except StoreError:
            if held is not None and entries:  # it may have been written: both are fine
                held.unsure = str(entries[-1].seq)
            raise
        if held is not None and entries and int(reply[0]) == _OK:
            held.last, held.unsure = str(entries[-1].seq), ""
        elif int(reply[0]) in (_FENCED, _MOVED_ON):
            self._held.pop(session_id, None)
        if int(reply[0]) == _SEQ_CONFLICT:
            _check_entries(session_id, entries, int(reply[1]))  # raises, worded as everywhere
        _check_status(reply, session_id, fence, held)
        await self._index_activity(session_id, info)
        return int(reply[1]) if message is not None and len(reply) > 1 else 0

    async def write_snapshot(
        self,
        session_id: str,
        snapshot: bytes,
        seq: int,
        info: bytes,
        *,
        trim_upto: int,
        fence: int | None = None,
    ) -> None:
        _check_snapshot_seqs(session_id, seq, trim_upto, 0)
        _check_max_seq(session_id, seq)
        trim_upto = max(trim_upto, 0)
        held = self._holder(session_id, fence)
        args: list[str | bytes] = [
            _fence_arg(fence),
            info,
            snapshot,
            str(seq),
            str(trim_upto),
            f"{trim_upto + 1}-0",
            *_position_args(held),
            *_listing(session_id, info),
        ]
        keys = [*self._keys(session_id), *self._listing_key()]
        reply: Any = await self._write(
            "write a snapshot of", session_id, _WRITE_SNAPSHOT, keys, args
        )
        if int(reply[0]) == _OLDER_SNAPSHOT:
            _check_snapshot_seqs(session_id, seq, trim_upto, int(reply[1]))  # raises
        _check_status(reply, session_id, fence, held)
        await self._index_activity(session_id, info)

    async def read_journal(self, session_id: str, after: int) -> tuple[int, list[JournalEntry]]:
        meta, _info, log, _lease, _shard = self._keys(session_id)
        start = "-" if after < 0 else f"({min(after, _MAX_SEQ)}-0"
        reply: Any = await self._run(
            "read the journal of",
            session_id,
            lambda c: _READ_JOURNAL([meta, log], [start], client=c),
        )
        return self._journal_reply(session_id, after, reply)

    async def read_journal_page(
        self, session_id: str, after: int, *, limit: int, max_bytes: int
    ) -> tuple[int, list[JournalEntry]]:
        meta, _info, log, _lease, _shard = self._keys(session_id)
        start = "-" if after < 0 else f"({min(after, _MAX_SEQ)}-0"
        args = [start, str(min(max(limit, 1), _MAX_SEQ)), str(min(max(max_bytes, 0), _MAX_SEQ))]
        reply: Any = await self._run(
            "read the journal of",
            session_id,
            lambda c: _READ_JOURNAL_PAGE([meta, log], args, client=c),
        )
        return self._journal_reply(session_id, after, reply)

    def _journal_reply(
        self, session_id: str, after: int, reply: Any
    ) -> tuple[int, list[JournalEntry]]:
        """``(trimmed_upto, entries)`` of a journal script's reply (None: not stored)."""
        if reply is None:
            raise _not_found_error(session_id)
        trimmed, entries = reply
        what = "the journal's trimmed seq"
        trimmed = _check_stored_seq(session_id, _stored_int(trimmed), what)
        return trimmed, _entries(session_id, entries, min(max(after, 0), _MAX_SEQ))

    async def list_sessions(self) -> list[tuple[str, bytes]]:
        async def run(client: Client) -> list[tuple[str, bytes]]:
            # Every group's index in one pipeline (on a cluster, one per master), then
            # the infos of each group's members: one slot per MGET.
            async with _pipeline(client) as pipe:
                replies = [pipe.smembers(self._group_key(g, "sessions")) for g in range(_GROUPS)]
            batches: list[list[str]] = []
            for reply in replies:
                names = sorted(n for m in await reply if (n := _decode_name(m)) is not None)
                batches += [names[i : i + _MGET_CHUNK] for i in range(0, len(names), _MGET_CHUNK)]
            if not batches:
                return []
            async with _pipeline(client) as pipe:
                infos = [pipe.mget([self._keys(name)[1] for name in names]) for names in batches]
            found: list[tuple[str, bytes]] = []
            for names, reply in zip(batches, infos, strict=True):
                # A session deleted between the two reads has no info: skip it.
                found += [(n, i) for n, i in zip(names, await reply, strict=True) if i is not None]
            found.sort()
            return found

        return await self._run("list", None, run)

    # -- the listing order (a sorted set beside the sessions' keys) ------------------

    @property
    def _activity_key(self) -> str:
        return f"{self.prefix}:activity"

    def _listing_key(self) -> list[str]:
        """The listing order's key, for a write script to list its session in the same
        step (one server), or none (a cluster: it sits in a slot of its own)."""
        return [] if self._on_cluster else [self._activity_key]

    @property
    def _publishes_on_append(self) -> bool:
        """Whether an append may publish a message in the same step (one server, no
        replicas to wait for: redis sends it only once the write is on its disk)."""
        return not self._on_cluster and not self._target.replicas

    @property
    def _on_cluster(self) -> bool:
        return self._target.cluster or isinstance(self._client, coredis.RedisCluster)

    async def _index_activity(self, session_id: str, info: bytes | None) -> None:
        """On a cluster, put the session in the listing order after a write of its
        ``info`` (take it out after a delete: ``None``); on one server the write's
        script did (see ``_listing_key``).

        A command of its own after the write, not a step of it: a process that dies
        in between, or a failure of that command (which does not fail the write),
        leaves the order a step behind, which ``list_page`` mends (a
        member without info is skipped and removed, a session without a member is
        added), and the session's next write puts right. An order that holds another
        type of value does not fail the write either (it landed): it is logged at
        ERROR, and the listings fail with ``StoreConfigurationError`` until it is fixed.
        """
        if not self._on_cluster:
            await trio.lowlevel.checkpoint()
            return
        member, score = _listing(session_id, info)
        key = self._activity_key
        try:
            if info is None:
                await self._run("unlist", session_id, lambda c: c.zrem(key, [member]))
            else:
                scores: dict[str | bytes, int | float] = {member: int(score)}
                await self._run("list", session_id, lambda c: c.zadd(key, scores))
        except StoreConfigurationError as exc:
            if not _wrong_type(exc.__cause__):
                raise
            # The write stands; only the order, a key the sessions share, is damaged
            self._listing_mended = False
            log.error("the listing order of %r could not be written: %s", session_id, exc)
        except StoreNotDurableError:
            raise
        except StoreError as exc:
            # The write stands (the order's master may be down while the session's is
            # up): the order is a step behind, as after a process died here, and this
            # store's next listing looks for the sessions it lacks again.
            self._listing_mended = False
            log.warning("the listing order of %r is a step behind: %s", session_id, exc)

    async def list_page(self, *, after: str | None, limit: int) -> list[tuple[str, bytes]]:
        return await self._page(None, after, limit)

    async def list_idle_page(
        self, *, active_before: int, after: str | None, limit: int
    ) -> list[tuple[str, bytes]]:
        return await self._page(active_before, after, limit)

    async def _page(
        self, active_before: int | None, after: str | None, limit: int
    ) -> list[tuple[str, bytes]]:
        """A page of the listing, of the sessions active before ``active_before`` (if
        given): the members of the listing order past the ones scored as active since."""
        key = self._activity_key

        async def run(client: Client) -> list[tuple[str, bytes]]:
            if not self._listing_mended:  # once per store object: see _add_unlisted
                await self._add_unlisted(client)
                self._listing_mended = True
            start = 0
            if after is not None:
                rank = await client.zrevrank(key, name_bytes(after).hex())
                if rank is None:
                    raise after_not_found(after)
                start = int(rank) + 1  # type: ignore[arg-type]
            if active_before is not None:  # the sessions active since come first
                start = max(start, await client.zcount(key, active_before, "+inf"))
            page: list[tuple[str, bytes]] = []
            while len(page) < limit:
                want = limit - len(page)
                members = await client.zrange(key, start, start + want - 1, rev=True)
                if not members:
                    break
                start += len(members)
                names = [_member_name(m) for m in members]
                # one slot per GET on a cluster; a session's info key of the wrong type
                # fails its own GET only (listed as unreadable), not the listing
                async with _pipeline(client, raise_on_error=False) as pipe:
                    replies = [pipe.get(self._keys(n)[1]) for n in names if n is not None]
                infos: list[bytes | None] = []
                answers = iter(replies)
                for name in names:
                    infos.append(None if name is None else await _info_reply(next(answers)))
                gone = [m for m, i in zip(members, infos, strict=True) if i is None]
                if gone:  # deleted by a process that died before unlisting them (or stray)
                    await client.zrem(key, gone)
                    start -= len(gone)
                    await self._relist(client, gone)
                page += [
                    (n, i)
                    for n, i in zip(names, infos, strict=True)
                    if n is not None and i is not None
                ]
            return page

        return await self._run("list", after, run)

    async def _relist(self, client: Client, members: list[bytes]) -> None:
        """Put back in the listing order those of ``members``, just dropped as naming no
        session, whose session exists now: created again meanwhile by another process,
        whose own listing of it the drop may have undone."""
        names = [(m, n) for m in members if (n := _member_name(m)) is not None]
        async with _pipeline(client, raise_on_error=False) as pipe:
            replies = [pipe.get(self._keys(n)[1]) for _, n in names]
        back: dict[str | bytes, int | float] = {}
        for (member, _), reply in zip(names, replies, strict=True):
            info = await _info_reply(reply)
            if info is not None:
                back[member] = info_activity(info)
        if back:
            await client.zadd(self._activity_key, back, condition=coredis.PureToken.NX)

    async def _add_unlisted(self, client: Client) -> None:
        """List the sessions stored without a place in the listing order (by an older
        version of this store, or a process that died between a create and its
        listing): only those, each scored by its info. Done at a store object's
        first listing, as it reads every session's info."""
        stored = await self.list_sessions()
        for start in range(0, len(stored), _MGET_CHUNK):
            chunk = [
                (name_bytes(name).hex(), info) for name, info in stored[start : start + _MGET_CHUNK]
            ]
            scores = await client.zmscore(self._activity_key, [m for m, _ in chunk])
            missing: dict[str | bytes, int | float] = {
                m: info_activity(i) for (m, i), s in zip(chunk, scores, strict=True) if s is None
            }
            if missing:
                await client.zadd(self._activity_key, missing, condition=coredis.PureToken.NX)

    async def exists(self, session_id: str) -> bool:
        meta = self._keys(session_id)[0]
        count = await self._run("look up", session_id, lambda c: c.exists([meta]))
        return bool(count)

    async def delete(self, session_id: str) -> bool:
        keys = [*self._keys(session_id), self._index_key(session_id), *self._listing_key()]
        args = [_encode_name(session_id), _listing(session_id, None)[0]]
        existed: Any = await self._write("delete", session_id, _DELETE, keys, args)
        await self._index_activity(session_id, None)
        return bool(existed)

    async def claim(self, session_id: str, owner: str, ttl: float) -> Lease | None:
        args = [owner, _ttl_ms(ttl)]
        meta, _info, _log, lease_key, shard = self._keys(session_id)
        reply: Any = await self._run(
            "claim",
            session_id,
            lambda c: _CLAIM(
                [lease_key, self._fence_key(session_id), meta, shard, self._watch_key(session_id)],
                args,
                client=c,
            ),
        )
        if reply is None:
            return None
        fence, last, epoch = int(reply[0]), bytes(reply[1]).decode(), bytes(reply[2]).decode()
        self._held[session_id] = _Held(fence, owner, last, epoch, watched=bool(int(reply[3])))
        return Lease(owner=owner, fence=fence)

    def _take_watched(self, session_id: str) -> bool:
        """Whether the claim of ``session_id``'s lease found another worker subscribed
        (asked once per claim: the multi-worker transport then publishes its events)."""
        held = self._held.get(session_id)
        if held is None or not held.watched:
            return False
        held.watched = False
        return True

    def _holder(self, session_id: str, fence: int | None) -> _Held | None:
        """What this store knows of the lease ``fence`` (None: it was not claimed here)."""
        held = self._held.get(session_id)
        return held if held is not None and fence is not None and held.fence == fence else None

    async def renew(self, session_id: str, lease: Lease, ttl: float) -> bool:
        args = [lease.owner, str(lease.fence), _ttl_ms(ttl)]
        keys = list(self._keys(session_id)[3:])
        renewed: Any = await self._run(
            "renew the lease of", session_id, lambda c: _RENEW(keys, args, client=c)
        )
        return bool(renewed)

    async def renew_many(self, leases: Mapping[str, Lease], ttl: float) -> set[str]:
        """Renew the shards that hold ``leases`` in one round trip (on a cluster, one
        per master): the names whose leases are no longer held (their shard was lost)."""
        ms = _ttl_ms(ttl)
        shards: dict[tuple[int, str], list[str]] = {}  # (group, epoch) -> sessions
        lost: set[str] = set()
        for name, lease in leases.items():
            held = self._holder(name, lease.fence)
            if held is None or held.owner != lease.owner:
                lost.add(name)  # not claimed through this store: no shard to renew
            else:
                shards.setdefault((_group(name), held.epoch), []).append(name)
        owners = {name: leases[name].owner for names in shards.values() for name in names}

        async def run(client: Client) -> list[Any]:
            async with _pipeline(client) as pipe:
                replies: list[Any] = [
                    _RENEW_SHARD(
                        [self._shard_key(group)],
                        [owners[names[0]], epoch, ms],
                        client=pipe,
                    )
                    for (group, epoch), names in shards.items()
                ]
            return [await reply for reply in replies]

        if not shards:
            await trio.lowlevel.checkpoint()
            return lost
        held_still: list[bool | StoreError]
        try:
            doing, about = _renewing(sum(len(names) for names in shards.values()))
            held_still = await self._run(doing, None, run, about=about)
        except StoreError:
            if not self._on_cluster:
                raise
            # A cluster's pipeline of scripts needs every master (the client asks each
            # whether it has the script): one down fails it. Shard by shard, those on
            # the masters still up are renewed.
            held_still = await self._renew_apart(shards, owners, ms)
        unanswered: set[str] = set()
        for names, outcome in zip(shards.values(), held_still, strict=True):
            if isinstance(outcome, StoreError):
                unanswered.update(names)
            elif not outcome:
                lost.update(names)
        if unanswered:
            failure = next(o for o in held_still if isinstance(o, StoreError))
            raise LeasesUnrenewedError(
                f"{failure} (the leases of {len(unanswered)} of {len(owners)} sessions; "
                "the others were renewed)",
                lost=frozenset(lost),
                unanswered=frozenset(unanswered),
            )
        return lost

    async def _renew_apart(
        self, shards: dict[tuple[int, str], list[str]], owners: dict[str, str], ms: str
    ) -> list[bool | StoreError]:
        """``renew_many``'s shards renewed one call each, all at once: whether each is
        still held, or the error its renewal met."""
        held_still: list[bool | StoreError] = [False] * len(shards)

        async def renew(i: int, group: int, epoch: str, names: list[str]) -> None:
            args = [owners[names[0]], epoch, ms]
            doing, about = _renewing(len(names))
            try:
                reply: Any = await self._run(
                    doing,
                    None,
                    lambda c: _RENEW_SHARD([self._shard_key(group)], args, client=c),
                    about=about,
                )
            except StoreError as exc:
                held_still[i] = exc
            else:
                held_still[i] = bool(reply)

        async with trio.open_nursery() as nursery:
            for i, ((group, epoch), names) in enumerate(shards.items()):
                nursery.start_soon(renew, i, group, epoch, names)
        return held_still

    async def release(self, session_id: str, lease: Lease) -> None:
        args = [lease.owner, str(lease.fence)]
        keys = list(self._keys(session_id)[3:])
        if self._holder(session_id, lease.fence) is not None:
            del self._held[session_id]
        await self._run(
            "release the lease of", session_id, lambda c: _RELEASE(keys, args, client=c)
        )

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None or conn.token is not trio.lowlevel.current_trio_token():
            # Nothing open in this run (a client opened by an earlier run died with it).
            await trio.lowlevel.checkpoint()
            return
        conn.close()
        await conn.done.wait()
