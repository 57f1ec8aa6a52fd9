"""The turns that running code is part of, so that a request that would wait on one of
them is refused: it would wait forever.

A session serves its mailbox one request at a time, so code that runs inside one of
its turns (its model, its tools, the tasks they start) cannot wait for a request in
that mailbox: the request comes after the turn, which waits on it. Nor can it wait
for one in the mailbox of a session whose turn waits on this one (A's tool sends to
B, whose tool sends to A). Each turn runs with the chain of turns that wait on it
(``within()``): its own session's, then those its caller's chain named, which a turn
carries from its ``send`` into the mailbox. Sessions are named with the registry's
own object (its sessions), as two registries may each have one of the same name.

A turn forwarded to another worker does not carry its chain: a cycle through other
workers is cut by the agents' ``turn_timeout``.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Final, Protocol

from ._errors import SessionBusyError

__all__ = ["WITHIN", "Chain", "Fixed", "Within", "refuse_within", "within", "within_error"]

#: ``(the registry's sessions, session name)`` of each turn the running code is part
#: of, the innermost first.
Within = tuple[tuple[object, str], ...]


class Chain(Protocol):
    """What ``WITHIN`` holds: the chain of turns, told when asked (an actor tells its
    turn's, none between turns, at no cost to a turn that makes no request)."""

    def within(self) -> Within: ...


class Fixed:
    """A chain that does not change (that of an asyncio caller, carried into trio)."""

    __slots__ = ("chain",)

    def __init__(self, chain: Within) -> None:
        self.chain = chain

    def within(self) -> Within:
        return self.chain


#: Set by each actor for its own task (whose turns' tools and models, and the tasks
#: they start, inherit it); None outside every actor.
WITHIN: Final[ContextVar[Chain | None]] = ContextVar("sessionactors_within", default=None)


def within() -> Within:
    """The turns the running code is part of (none outside any turn)."""
    chain = WITHIN.get()
    return () if chain is None else chain.within()


def refuse_within(host: object, name: str) -> None:
    """Raise SessionBusyError if the running code is part of a turn that a request in
    the mailbox of session ``name`` (of ``host``) would wait behind."""
    holder = WITHIN.get()
    if holder is not None:
        chain = holder.within()
        if (host, name) in chain:
            raise within_error(chain, host, name)


def within_error(chain: Within, host: object, name: str) -> SessionBusyError:
    """The error of a request to session ``name`` made inside ``chain``, which holds it."""
    if chain[0] == (host, name):
        told = (
            f"session {name!r} is running the turn this request comes from (a tool or "
            "model of its own turn): the request would wait in its mailbox behind that "
            "turn, which waits on it, forever"
        )
    else:
        path = []
        for link in reversed(chain[: chain.index((host, name)) + 1]):
            path.append(repr(link[1]))
        told = (
            f"session {name!r} waits on the turn this request comes from (its turn "
            f"waits on {' -> '.join(path[1:])}, whose turn makes this request): the "
            f"request would wait in the mailbox of {name!r} behind that turn forever"
        )
    return SessionBusyError(
        f"{told}; submit it without waiting for its reply (ref.submit), or make it from "
        "outside the turn",
        session_id=name,
    )
