"""The death of a process, played inside one test."""

from __future__ import annotations

from .._registry import Registry
from ..aio._registry import Registry as AioRegistry
from ..aio._registry import trio_registry

__all__ = ["crash"]


def public_name(cls: type) -> str:
    """``cls`` as its public path names it (no private module: ``sessionactors.aio._registry``
    is ``sessionactors.aio``)."""
    module = ".".join(part for part in cls.__module__.split(".") if not part.startswith("_"))
    return f"{module}.{cls.__qualname__}" if module != "builtins" else cls.__qualname__


def crash(registry: Registry | AioRegistry) -> None:
    """Stop ``registry`` as the death of its process (``kill -9``) would: every session
    stops where it is, a turn in flight included, and nothing more is written to the
    store, not even at the registry's exit (a write already under way may still land,
    as it may when a process dies). What the store holds is what a new process finds.

    A process's death ends everything in it, so cancel the scope that stands for the
    process right after (leaving the block without that is only an exit that writes
    nothing)::

        with trio.CancelScope() as process:
            async with sa.open_registry(store=store, agents=agents) as registry:
                ...
                crash(registry)
                process.cancel()
        async with sa.open_registry(store=store, agents=agents) as registry:
            ...  # the next process

    Cancelling the scope alone is no death: a registry whose block is cancelled shuts
    down at once but still writes what it answered.

    It takes the registry of ``sessionactors.aio.open_registry`` too, called from
    asyncio code on the loop that opened it. Leave its block right after: the exit
    writes nothing, and the callers still waiting hear that the registry crashed::

        async with sessionactors.aio.open_registry(store=store, agents=agents) as registry:
            ...
            crash(registry)
        async with sessionactors.aio.open_registry(store=store, agents=agents) as registry:
            ...  # the next process

    From a sync test of an app (Starlette's ``TestClient``, whose loop runs in a
    thread of its own), call it on that loop: ``client.portal.call(crash, registry)``.
    """
    if isinstance(registry, AioRegistry):
        registry = trio_registry(registry)
    if not isinstance(registry, Registry):
        raise TypeError(
            "crash() takes a registry: the sessionactors.Registry of "
            "sessionactors.open_registry, or the sessionactors.aio.Registry of "
            "sessionactors.aio.open_registry; not "
            f"{public_name(type(registry))}"
        )
    registry._sessions.die()
