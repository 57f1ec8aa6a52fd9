"""Where a ``RedisStore`` connects: its URL's deployment, the client for it, and the
persistence check every new connection passes before it is used.

A client the store opens checks each of its connections as it opens, after the
handshake and before the connection is handed to any command (``check_connection``):
a server restarted on the same address, a Sentinel's new master or a cluster's
promoted replica is only ever reached over a new connection, so nothing the store
sends reaches a server that has not passed the check.

URLs::

    redis://[[user]:password@]host[:port][/db]      one server (rediss:// with TLS,
    unix://[[user]:password@]/path/to/socket         unix:// over a local socket)
    redis+cluster://[[user]:password@]host:port[,host:port...]   a Redis Cluster
                                                     (rediss+cluster:// with TLS)
    redis+sentinel://host:port[,host:port...]/service[/db]       the master that
                                                     Sentinel names ``service``

Every URL takes ``?persistence=always|everysec|volatile`` (see :data:`PERSISTENCE`),
``?replicas=N``, ``?replica_timeout=seconds`` and ``?prefix=`` (see ``RedisStore``); a ``redis://``
URL also takes those of coredis' own query options that leave its replies as the store
reads them (see ``_CLIENT_OPTIONS``), and is refused with any other.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, Final, Literal, TypeAlias, get_args
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

import attrs
import coredis
import coredis.exceptions
import trio
from coredis.connection import BaseConnection, TCPLocation
from coredis.pool import BaseConnectionPool, SentinelConnectionPool
from coredis.retry import CompositeRetryPolicy, ConstantRetryPolicy, NoRetryPolicy, RetryPolicy

from .._errors import StoreConfigurationError, StoreNotDurableError
from .._names import redact

__all__ = [
    "DEFAULT_REPLICA_TIMEOUT",
    "PERSISTENCE",
    "Client",
    "Persistence",
    "ServerNotDurable",
    "Target",
    "check_deployment",
    "check_persistence",
    "open_client",
]


def _only_cancelled(exc: BaseException) -> bool:
    """Whether ``exc`` is a cancellation, or a group of nothing else."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_only_cancelled(inner) for inner in exc.exceptions)
    return isinstance(exc, trio.Cancelled)


class _CancelledIsNoFailure(logging.Filter):
    """Drops what the Redis client logs of a connection that a cancellation cut short
    as it opened (a store call given up by its caller or its deadline, a store or a
    registry closing): "Connection attempt failed unexpectedly!" at ERROR, with a
    traceback of cancellations, is no failure, and would page an operator for none.
    A connection that failed otherwise is still logged (and its store call fails)."""

    def filter(self, record: logging.LogRecord) -> bool:
        failure = record.exc_info[1] if record.exc_info else None
        return failure is None or not _only_cancelled(failure)


logging.getLogger("coredis").addFilter(_CancelledIsNoFailure())

#: Any coredis client: one server, a cluster, or a Sentinel's master.
Client: TypeAlias = coredis.client.Client[bytes]

Persistence: TypeAlias = Literal["always", "everysec", "volatile"]
#: What a store demands of its server before it writes:
#: ``"always"`` (the default): ``appendonly yes`` and ``appendfsync always``, every
#: acknowledged write is on disk; ``"everysec"``: ``appendonly yes`` with at least
#: ``appendfsync everysec``, a machine crash or power loss can take up to about a
#: second of acknowledged writes; ``"volatile"``: no check, for tests and caches
#: (without persistence a restart loses everything).
PERSISTENCE: Final[tuple[Persistence, ...]] = get_args(Persistence)

#: Seconds a write waits for its replicas (RedisStore's replica_timeout).
DEFAULT_REPLICA_TIMEOUT: Final = 1.0
#: The query options every store URL takes (a redis:// URL's others go to coredis).
_OPTIONS: Final = ("persistence", "replicas", "replica_timeout", "prefix")

#: The TLS options a ``rediss+cluster://`` URL takes (those of ``rediss://``, which
#: coredis reads itself): the CA to check the nodes against, a client certificate.
_TLS_OPTIONS: Final = (
    "ssl_ca_certs",
    "ssl_cert_reqs",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_check_hostname",
)
_CERT_REQS: Final = ("none", "optional", "required")
#: The client's own query options a ``redis://`` URL may take, and what each must be
#: (the others coredis ignores, or, like ``decode_responses`` or ``noreply``, would
#: break the store).
_CLIENT_OPTIONS: Final[Mapping[str, type[int] | type[float] | type[str]]] = {
    "db": int,
    "client_name": str,
    "max_connections": int,
    "timeout": int,
    "connect_timeout": float,
    "stream_timeout": float,
    "max_idle_time": int,
    "noevict": str,
    "notouch": str,
    "username": str,
    "password": str,
}
#: The spellings of ``ssl_check_hostname`` (those coredis takes in a ``rediss://`` URL).
_BOOLEANS: Final = {
    **dict.fromkeys(("1", "t", "true", "y", "yes"), True),
    **dict.fromkeys(("0", "f", "false", "n", "no"), False),
}

_STANDALONE: Final = ("redis", "rediss", "unix")
_CLUSTER: Final = ("redis+cluster", "rediss+cluster")
_SENTINEL: Final = ("redis+sentinel",)
SCHEMES: Final = (*_STANDALONE, *_CLUSTER, *_SENTINEL)


# A cluster client retries only what the server refused before running it (a slot
# moving, the cluster not ready yet); a lost connection is the caller's to judge.
def _cluster_retry(patience: float) -> RetryPolicy:
    """The retries of a cluster client whose calls may take ``patience`` seconds: the
    cluster not ready (a few times), and for up to half of them a slot being migrated
    to another master (resharding). While it migrates, Redis refuses a script whose
    keys are not all on one side (TRYAGAIN, ASK), and a session's scripts name keys
    that need not exist (its lease, its shard's): coredis follows the redirections a
    few times (about half a second), then raises ``ClusterError`` (only then), the
    command not run. A call that still meets it raises it well before ``patience``."""
    down = ConstantRetryPolicy((coredis.exceptions.ClusterDownError,), retries=2, delay=0.1)
    moving = patience / 2 - 0.5
    if moving <= 0:
        return down
    redirected = (coredis.exceptions.ClusterError,)
    return CompositeRetryPolicy(
        down, ConstantRetryPolicy(redirected, retries=None, deadline=moving, delay=0.05)
    )


def _from_query(raw: str, kind: type[int] | type[float]) -> object:
    """A number given in a URL's query, or ``raw`` itself for the check to refuse."""
    try:
        return kind(raw) if raw.strip() == raw and raw.isascii() else raw
    except ValueError:
        return raw


def _replicas(given: object, url: str) -> int:
    """``replicas``, checked: a whole number of replicas, 0 or more."""
    if isinstance(given, bool) or not isinstance(given, int) or given < 0:
        raise ValueError(
            f"redis replicas {given!r} (for {redact(url)}) is not a whole number of "
            "replicas; pass 0 (the default: no wait) or the number of replicas every "
            "acknowledged write must reach, such as replicas=1"
        )
    return given


def _replica_timeout(given: object, url: str) -> float:
    """``replica_timeout``, checked: a positive, finite number of seconds."""
    if isinstance(given, bool) or not isinstance(given, int | float) or not 0 < given < math.inf:
        raise ValueError(
            f"redis replica_timeout {given!r} (for {redact(url)}) is not a positive number "
            f"of seconds; pass one such as {DEFAULT_REPLICA_TIMEOUT}"
        )
    return float(given)


def _tls_options(query: dict[str, str], scheme: str, url: str) -> dict[str, Any]:
    """The TLS options of a cluster URL (taken out of ``query``), checked, as
    ``coredis.RedisCluster`` takes them (those of a ``rediss://`` URL are checked alike)."""
    found: dict[str, str] = {name: query.pop(name) for name in _TLS_OPTIONS if name in query}
    if found and scheme not in ("rediss+cluster", "rediss"):
        raise ValueError(
            f"redis url {redact(url)!r}: {', '.join(found)} configure TLS, which "
            f"{scheme}:// does not use; write rediss+cluster://"
        )
    options: dict[str, Any] = dict(found)
    reqs = found.get("ssl_cert_reqs")
    if reqs is not None and reqs not in _CERT_REQS:
        raise ValueError(
            f"redis url {redact(url)!r}: ssl_cert_reqs={reqs!r} is not one of "
            f"{', '.join(_CERT_REQS)}; 'required' checks the nodes' certificates"
        )
    check = found.get("ssl_check_hostname")
    if check is not None:
        if check and check.lower() not in _BOOLEANS:
            raise ValueError(
                f"redis url {redact(url)!r}: ssl_check_hostname={check!r} is not true or false"
            )
        options["ssl_check_hostname"] = _BOOLEANS.get(check.lower())
        if options["ssl_check_hostname"] and reqs == "none":
            raise ValueError(
                f"redis url {redact(url)!r}: ssl_cert_reqs=none checks no certificate, so "
                "there is no host name to check; drop ssl_check_hostname or ask for "
                "ssl_cert_reqs=required"
            )
    if ("ssl_certfile" in found) != ("ssl_keyfile" in found):
        raise ValueError(
            f"redis url {redact(url)!r}: a client certificate takes both ssl_certfile and "
            "ssl_keyfile (the key may be the same file)"
        )
    return options


def _client_options(query: Mapping[str, str], scheme: str, path_db: str, url: str) -> None:
    """Refuse the query options of a one-server ``url`` that the store cannot use as
    written: unknown (a misspelling nothing would read), breaking the store, TLS options
    without TLS, values the client could not read, a database given twice."""
    tls = _TLS_OPTIONS if scheme == "rediss" else ()
    for name, value in query.items():
        if name in _TLS_OPTIONS and not tls:
            raise ValueError(
                f"redis url {redact(url)!r}: {name} configures TLS, which {scheme}:// does "
                "not use; write rediss://"
            )
        kind = _CLIENT_OPTIONS.get(name)
        if kind is None and name not in tls:
            raise ValueError(
                f"redis url {redact(url)!r}: the store does not take the option {name!r}; "
                f"drop it, or use one of {', '.join((*_OPTIONS, *_CLIENT_OPTIONS, *tls))}"
            )
        if (kind is int or kind is float) and not isinstance(_from_query(value, kind), kind):
            what = "database number" if name == "db" else f"{kind.__name__} for {name}"
            raise ValueError(f"redis url {redact(url)!r}: {value!r} is not a {what}")
    if path_db and "db" in query and int(query["db"]) != int(path_db):
        raise ValueError(
            f"redis url {redact(url)!r} names two databases, {path_db} in its path and "
            f"{query['db']} in db=; name one"
        )


def _locations(netloc: str, url: str) -> list[TCPLocation]:
    locations = []
    for item in netloc.rpartition("@")[2].split(","):
        host, colon, port = item.rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(
                f"redis url {redact(url)!r}: {item!r} is not host:port; write every node or "
                "sentinel as host:port, separated by commas"
            )
        locations.append(TCPLocation(host.strip("[]"), int(port)))
    return locations


@attrs.frozen(kw_only=True)
class Target:
    """A parsed store URL: what to connect to and what to demand of it."""

    url: str
    scheme: str
    persistence: Persistence
    replicas: int = 0
    replica_timeout: float = DEFAULT_REPLICA_TIMEOUT
    query: Mapping[str, str] = attrs.field(factory=dict)
    tls: Mapping[str, Any] = attrs.field(factory=dict)  # (a cluster's: see _TLS_OPTIONS)
    locations: tuple[TCPLocation, ...] = ()
    service: str = ""
    db: int = 0
    prefix: str | None = None  # the URL's ?prefix= (None: not given)

    @classmethod
    def parse(
        cls,
        url: str,
        persistence: str | None,
        replicas: int | None = None,
        replica_timeout: float | None = None,
    ) -> Target:
        """Check ``url`` (and ``persistence``, ``replicas`` and ``replica_timeout``,
        which the URL's options may name too, but not differently); no I/O."""
        parts = urlsplit(url)
        if parts.scheme not in SCHEMES:
            raise ValueError(
                f"redis url {redact(url)!r} is not a redis://, rediss://, unix://, "
                "redis+cluster:// or redis+sentinel:// url; pass one like "
                "'redis://127.0.0.1:6379/0'"
            )
        before_query = url.partition("://")[2].partition("?")[0]  # (a value may hold "@")
        if "@" not in parts.netloc and "@" in before_query:
            raise ValueError(
                f"redis url {redact(url)!r}: its user name or password holds a character "
                "that a URL reserves ('/', '?', '#' or '@'); percent-encode them, e.g. "
                "urllib.parse.quote(password, safe='')"
            )
        query = dict(parse_qsl(parts.query, keep_blank_values=True))
        options = {name: query.pop(name) for name in _OPTIONS if name in query}
        given = (
            ("persistence", persistence, None),
            ("replicas", replicas, int),
            ("replica_timeout", replica_timeout, float),
        )
        for name, value, kind in given:
            if value is None or name not in options:
                continue
            in_url = options[name] if kind is None else _from_query(options[name], kind)
            if in_url != value:
                raise ValueError(
                    f"redis url {redact(url)!r} names {name} {options[name]!r} and "
                    f"{name}= names {value!r}; name one"
                )
        chosen = persistence or options.get("persistence") or "always"
        if chosen not in PERSISTENCE:
            raise ValueError(
                f"redis persistence {chosen!r} is not one of {', '.join(PERSISTENCE)}; "
                "'always' keeps every acknowledged write"
            )
        found: Persistence = chosen
        count = _replicas(
            _from_query(options.get("replicas", "0"), int) if replicas is None else replicas,
            url,
        )
        patience = _replica_timeout(
            _from_query(options.get("replica_timeout", str(DEFAULT_REPLICA_TIMEOUT)), float)
            if replica_timeout is None
            else replica_timeout,
            url,
        )
        if parts.scheme in _STANDALONE:
            db = parts.path.strip("/") if parts.scheme != "unix" else ""
            if db and not (db.isascii() and db.isdigit()):
                raise ValueError(
                    f"redis url {redact(url)!r}: {db!r} is not a database number; write "
                    "redis://host:port/N with N a number (0 if not given)"
                )
            if parts.scheme == "unix" and not parts.path:
                raise ValueError(
                    f"redis url {redact(url)!r} names no socket; write unix:///path/to/redis.sock"
                )
            if parts.scheme != "unix" and not parts.hostname:
                raise ValueError(
                    f"redis url {redact(url)!r} names no host; write "
                    f"{parts.scheme}://host:port/N, as in 'redis://127.0.0.1:6379/0'"
                )
            try:
                parts.port  # noqa: B018 (it checks the port)
            except ValueError:
                raise ValueError(
                    f"redis url {redact(url)!r}: its port is not a number from 1 to 65535; "
                    "write redis://host:port/N, as in 'redis://127.0.0.1:6379/0'"
                ) from None
            _client_options(query, parts.scheme, db, url)
            if parts.scheme == "rediss":  # (coredis reads them from the query itself)
                _tls_options(dict(query), parts.scheme, url)
            return cls(
                url=url,
                scheme=parts.scheme,
                persistence=found,
                query=query,
                replicas=count,
                replica_timeout=patience,
                prefix=options.get("prefix"),
            )
        tls = _tls_options(query, parts.scheme, url) if parts.scheme in _CLUSTER else {}
        if query:
            takes = (*_OPTIONS, *(_TLS_OPTIONS if parts.scheme == "rediss+cluster" else ()))
            raise ValueError(
                f"redis url {redact(url)!r}: {parts.scheme}:// takes no option but "
                f"{', '.join(takes)}; drop " + ", ".join(sorted(query))
            )
        locations = tuple(_locations(parts.netloc, url))
        if parts.scheme in _CLUSTER:
            if parts.path.strip("/") not in ("", "0"):
                raise ValueError(
                    f"redis url {redact(url)!r}: a Redis Cluster has one database, 0, so "
                    f"it takes no database {parts.path.strip('/')!r}; drop the path (or "
                    "use another prefix= to keep applications apart)"
                )
            return cls(
                url=url,
                scheme=parts.scheme,
                persistence=found,
                locations=locations,
                replicas=count,
                replica_timeout=patience,
                tls=tls,
                prefix=options.get("prefix"),
            )
        service, _, db = parts.path.strip("/").partition("/")
        if not service or not (db or "0").isdigit():
            raise ValueError(
                f"redis url {redact(url)!r} names no service: write "
                "redis+sentinel://host:port/service or .../service/db"
            )
        if "@" in parts.netloc:
            raise ValueError(
                f"redis url {redact(url)!r}: a redis+sentinel:// url takes no password; "
                "pass an opened client with client= instead"
            )
        return cls(
            url=url,
            scheme=parts.scheme,
            persistence=found,
            locations=locations,
            service=service,
            db=int(db or "0"),
            replicas=count,
            replica_timeout=patience,
            prefix=options.get("prefix"),
        )

    @property
    def cluster(self) -> bool:
        return self.scheme in _CLUSTER

    @property
    def sentinel(self) -> bool:
        return self.scheme in _SENTINEL


class ServerNotDurable(coredis.exceptions.RedisError):
    """A connection being opened reached a server that can lose acknowledged writes:
    the connection is dropped before any command goes over it. Its message is the
    ``StoreNotDurableError``'s."""


#: A check of a connection as it opens (see ``coredis``' connect callbacks).
_Check: TypeAlias = Callable[[BaseConnection], Awaitable[None]]


def _check_as_opened(pool: BaseConnectionPool[Any], check: _Check) -> None:
    """Have the connections that ``pool`` opens pass ``check`` as they open: they are
    made of a subclass of its connection class."""
    base = pool.connection_class

    def __init__(self: BaseConnection, *args: Any, **kwargs: Any) -> None:
        base.__init__(self, *args, **kwargs)
        self.register_connect_callback(check)

    pool.connection_class = type(f"Checked{base.__name__}", (base,), {"__init__": __init__})


def _checking_sentinel_pool(check: _Check) -> type[SentinelConnectionPool]:
    """A Sentinel's pool whose connections (to the current master) pass ``check`` as
    they open (the pool makes its connections itself, whatever its connection class)."""

    class CheckedSentinelPool(SentinelConnectionPool):
        async def _construct_connection(self) -> Any:
            connection = await super()._construct_connection()
            connection.register_connect_callback(check)
            return connection

    return CheckedSentinelPool


@contextlib.asynccontextmanager
async def open_client(target: Target, patience: float) -> AsyncIterator[Client]:
    """The opened client for ``target``, closed on exit; its calls may take ``patience``
    seconds (the store's timeout). Unless ``target.persistence`` is ``"volatile"``,
    every connection it opens passes ``check_connection`` before its first command."""
    check = (
        None
        if target.persistence == "volatile"
        else functools.partial(check_connection, target=target, where=redact(target.url))
    )
    if target.scheme in _STANDALONE:
        parts = urlsplit(target.url)
        url = urlunsplit(parts._replace(query=urlencode(dict(target.query))))
        client = coredis.Redis.from_url(  # user info is percent-encoded (RFC 3986)
            url, retry_policy=NoRetryPolicy(), decode_components=True
        )
        if check is not None:
            _check_as_opened(client.connection_pool, check)
        async with client:
            yield client
    elif target.cluster:
        parts = urlsplit(target.url)
        user, colon, password = parts.netloc.rpartition("@")[0].partition(":")
        cluster = coredis.RedisCluster[bytes](
            startup_nodes=target.locations,
            username=unquote(user) or None,
            password=unquote(password) if colon else None,
            ssl=target.scheme.startswith("rediss"),
            **target.tls,
            retry_policy=_cluster_retry(patience),
            decode_responses=False,
        )
        if check is not None:  # (the connections to the masters that serve the slots)
            _check_as_opened(cluster.connection_pool, check)
        async with cluster:
            yield cluster
    else:
        pools = SentinelConnectionPool if check is None else _checking_sentinel_pool(check)
        async with (
            coredis.Sentinel(target.locations, retry_policy=NoRetryPolicy()) as sentinel,
            sentinel.primary_for(
                target.service, db=target.db, connection_pool_class=pools
            ) as primary,
        ):
            yield primary


#: What to do when a plain url reaches a Redis Cluster node.
USE_CLUSTER_URL: Final = (
    "connect with a redis+cluster://host:port url (rediss+cluster:// with TLS), "
    "listing one or more of the cluster's nodes"
)


async def check_deployment(client: Client, target: Target, where: str) -> None:
    """Raise ``StoreConfigurationError`` if a client for one server reached a node of a
    Redis Cluster (it would reach only the slots that node serves)."""
    if isinstance(client, coredis.RedisCluster):
        return
    try:
        info: Any = await client.info("cluster")
    except coredis.exceptions.ResponseError:
        return  # INFO is not allowed: a MOVED reply says so later (see RedisStore._run)
    if str(info.get("cluster_enabled", "0")) == "1":
        scheme = urlsplit(target.url).scheme
        raise StoreConfigurationError(
            f"redis at {where} is a node of a Redis Cluster, which a {scheme}:// url "
            "cannot use (a session's keys live on the master that serves their slot); "
            f"a retry cannot fix this: {USE_CLUSTER_URL}"
        )


def _problem(
    appendonly: bytes | None, fsync: bytes | None, evicts: str | None, wanted: Persistence
) -> str | None:
    """What the server's settings risk against ``wanted`` (None: nothing)."""
    if evicts is not None:
        return (
            f"maxmemory is set with maxmemory-policy {evicts}, so redis deletes keys when "
            "its memory runs short: stored turns, or whole sessions, gone without a word"
        )
    if appendonly != b"yes":
        return (
            "appendonly is off, so a restart loses every write since the last RDB "
            "snapshot (all of them without one)"
        )
    if fsync == b"always":
        return None
    if fsync is None:
        if wanted == "everysec":
            return None
        return (
            "appendfsync cannot be read (CONFIG GET is refused), so the store cannot "
            "tell that every write reaches the disk"
        )
    if fsync == b"everysec":
        if wanted == "everysec":
            return None
        return (
            "appendfsync is everysec, so a machine crash or power loss can take up to "
            "about a second of acknowledged writes"
        )
    return (
        f"appendfsync is {fsync.decode(errors='replace')}, so the operating system "
        "decides when writes reach the disk and a machine crash can take any of them"
    )


def _evicts(memory: Mapping[Any, Any]) -> str | None:
    """The eviction policy in ``INFO memory``'s fields if the server evicts (maxmemory
    set, a policy other than noeviction)."""
    policy = str(memory.get("maxmemory_policy", "noeviction"))
    return policy if int(memory.get("maxmemory", 0) or 0) and policy != "noeviction" else None


async def _settings(client: Client) -> tuple[bytes | None, bytes | None, str | None]:
    """``appendonly`` and ``appendfsync`` of one server (``appendfsync`` is None when
    only INFO can be read), and its eviction policy if it evicts."""
    memory: Any = await client.info("memory")
    try:
        got: Any = await client.config_get(["appendonly", "appendfsync"])
        return got.get(b"appendonly"), got.get(b"appendfsync"), _evicts(memory)
    except coredis.exceptions.ResponseError:
        # CONFIG is disabled or not allowed for this user: INFO still says whether
        # the append-only file is on, not how often it is synced.
        info: Any = await client.info("persistence")
        enabled = str(info.get("aof_enabled", "0")) == "1"
        return (b"yes" if enabled else b"no"), None, _evicts(memory)


def _info_fields(reply: Any) -> dict[str, str]:
    """The ``name:value`` fields of a raw ``INFO`` reply."""
    text = bytes(reply).decode(errors="replace")
    return dict(line.partition(":")[::2] for line in text.splitlines() if ":" in line)


def _not_durable(where: str, problems: list[str]) -> str:
    """The message of ``StoreNotDurableError`` for the server(s) at ``where``."""
    return (
        f"redis at {where} can lose acknowledged writes: {'; '.join(problems)}. "
        "Run it with appendonly yes and appendfsync always, and without eviction "
        "(maxmemory-policy noeviction, or no maxmemory) (in redis.conf, or CONFIG SET "
        "appendonly yes, CONFIG SET appendfsync always, CONFIG SET maxmemory-policy "
        "noeviction, CONFIG REWRITE). "
        "To accept losing up to about a second of acknowledged writes on a machine crash "
        "(appendfsync everysec), pass RedisStore(url, persistence='everysec'); for tests "
        "and caches that may lose everything, persistence='volatile' "
        "(or ?persistence=... in the url)"
    )


async def check_connection(connection: BaseConnection, target: Target, where: str) -> None:
    """Raise ``ServerNotDurable`` if the server of ``connection``, which is opening (no
    command has gone over it), can lose writes it acknowledged, as
    ``target.persistence`` counts them: the same check as ``check_persistence``, in one
    round trip (two where CONFIG is refused)."""
    memory = connection.create_request(b"INFO", b"memory", decode=False)
    config = connection.create_request(
        b"CONFIG GET", b"appendonly", b"appendfsync", decode=False, raise_exceptions=False
    )
    evicts = _evicts(_info_fields(await memory))
    got: Any = await config
    if isinstance(got, coredis.exceptions.ResponseError):  # (see _settings)
        info = _info_fields(await connection.create_request(b"INFO", b"persistence", decode=False))
        settings = (b"yes" if info.get("aof_enabled") == "1" else b"no"), None
    else:
        settings = got.get(b"appendonly"), got.get(b"appendfsync")
    problem = _problem(*settings, evicts, target.persistence)
    if problem is not None:
        if target.cluster or target.sentinel:  # (the server that serves, of several)
            problem = f"master {connection.location}: {problem}"
        raise ServerNotDurable(_not_durable(where, [problem]))


async def check_persistence(client: Client, target: Target, where: str) -> None:
    """Raise ``StoreNotDurableError`` if a server behind ``client`` can lose writes it
    acknowledged, as ``target.persistence`` counts them."""
    if target.persistence == "volatile":
        return
    problems: list[str] = []
    if isinstance(client, coredis.RedisCluster):
        for node in client.primaries:
            async with node:
                problem = _problem(*await _settings(node), target.persistence)
            if problem is not None:
                location = node.connection_pool.location
                problems.append(f"master {location}: {problem}")
    else:
        problem = _problem(*await _settings(client), target.persistence)
        if problem is not None:
            problems.append(problem)
    if problems:
        raise StoreNotDurableError(_not_durable(where, problems))
