"""The turns that running code is part of, so that a request that would wait on one of
them is refused: it would wait forever.

A session serves its mailbox one request at a time, so a tool of one of its turns
(and the tasks the tool starts and waits for) cannot wait for a request in that
mailbox: the request comes after the turn, which waits on the tool. Nor can it wait
for one in the mailbox of a session whose turn waits on this one (A's tool sends to
B, whose tool sends to A). While a turn's tools run, their code runs with a
``Frame`` in ``WITHIN``, which tells, when a request asks, the chain of turns that
wait on them: the turn's own session first, then those its caller's chain named,
which a turn that its caller waits for carries from its ``send`` into the mailbox.
The frame ends with the tools' step, so a task a tool started that outlives it (a
job handed to the app) is part of no turn.
Sessions are named with the registry's own object (its sessions), as two registries
may each have one of the same name.

What it does not see, a turn's ``turn_timeout`` cuts: a cycle through a request that
waits in the mailbox of a session busy with another turn (A's tool asks B while B's
own turn asks A), through a turn submitted and then waited on, through a turn that a
review or a retry resumed, or through another worker (a forwarded turn carries no
chain).
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Final, Protocol

from ._errors import SessionBusyError

__all__ = [
    "WITHIN",
    "Chained",
    "Fixed",
    "Frame",
    "Within",
    "refuse_within",
    "within",
    "within_error",
]

#: ``(the registry's sessions, session name)`` of each turn the running code is part
#: of, the innermost first.
Within = tuple[tuple[object, str], ...]


class Chained(Protocol):
    """What a frame holds: the turns that wait on its code, told when asked (an actor
    tells its turn's; ``Fixed``, a chain taken into another task)."""

    def chain(self) -> Within: ...


class Fixed:
    """A chain taken from one task into another (an asyncio caller's, into trio)."""

    __slots__ = ("_chain",)

    def __init__(self, chain: Within) -> None:
        self._chain = chain

    def chain(self) -> Within:
        return self._chain


#: A frame: a one-item list of what tells the chain of turns its code is part of, or
#: of None once that code's step has ended (a task it started may outlive it).
Frame = list[Chained | None]

#: Set for the tools of each step of a turn (and the tasks they start, which inherit
#: it); None outside them.
WITHIN: Final[ContextVar[Frame | None]] = ContextVar("sessionactors_within", default=None)


def within() -> Within:
    """The turns the running code is part of (none outside a turn's tools)."""
    frame = WITHIN.get()
    if frame is None:
        return ()
    holder = frame[0]
    return () if holder is None else holder.chain()


def refuse_within(host: object, name: str, *, turn: bool = True) -> Within:
    """The turns the running code is part of; raise SessionBusyError if a request in
    the mailbox of session ``name`` (of ``host``) would wait behind one of them
    (``turn``: the request is a turn, which may be submitted without waiting)."""
    chain = within()
    if (host, name) in chain:
        raise within_error(chain, host, name, turn=turn)
    return chain


def within_error(chain: Within, host: object, name: str, *, turn: bool = True) -> SessionBusyError:
    """The error of a request to session ``name`` made inside ``chain``, which holds it
    (``turn``: as ``refuse_within``'s)."""
    if chain[0] == (host, name):
        told = (
            f"session {name!r} is running the turn this request comes from (a tool of "
            "its own turn): the request would wait in its mailbox behind that turn, which "
            "waits on it, forever"
        )
    else:
        path = [repr(link[1]) for link in reversed(chain[: chain.index((host, name)) + 1])]
        told = (
            f"session {name!r} waits on the turn this request comes from (its turn "
            f"waits on {' -> '.join(path[1:])}, whose turn makes this request): the "
            f"request would wait in the mailbox of {name!r} behind that turn forever"
        )
    if turn:
        advice = (
            "submit it without waiting for its reply (ref.submit), or make it from outside the turn"
        )
    else:  # (a tool's: its result is how a turn's work reaches the app)
        advice = (
            "make it from outside the turn (a tool returns what the app should do in its "
            "result, or the app makes the request once the reply is back)"
        )
    return SessionBusyError(f"{told}; {advice}", session_id=name)
