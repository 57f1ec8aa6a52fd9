"""The death of a process, played inside one test."""

from __future__ import annotations

from .._registry import Registry

__all__ = ["crash"]


def crash(registry: Registry) -> None:
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
    """
    if not isinstance(registry, Registry):
        raise TypeError(
            "crash() takes the sessionactors.Registry of sessionactors.open_registry, not "
            f"{type(registry).__module__}.{type(registry).__qualname__}"
        )
    registry._sessions.die()
