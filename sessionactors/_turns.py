"""Turn ids, and the rules that decide what became of a turn (``ref.turn_outcome``).

Pure (no trio); ``LiveSession.outcome`` applies the rules. A turn id names its
session (a short hash of the name) and the time it was issued, in microseconds
from a clock that never repeats or goes back in this process:
``turn_<tag>_<time>_<process>``. Together with the outcomes a session keeps
durably (the last :data:`MAX_TURN_RECORDS`), that decides every id:

- recorded: finished, failed or cancelled, as recorded;
- the session's open turn: running, or waiting on a review;
- refused before it started (while this incarnation lives): failed;
- stamped more than :data:`CLOCK_SKEW_US` before the session was created or after
  now, or longer than :data:`MAX_TURN_ID_CHARS`: never issued for it
  (TurnNotFoundError);
- in the live actor's mailbox: queued;
- issued no later than the newest record forgotten: its record is gone
  (TurnNotFoundError);
- any other id of this session's form: lost (an incarnation that could have
  run it is gone and none recorded it, or it was never accepted);
- not an id of this session's form: never issued for it (TurnNotFoundError).

The process that issues an id is the session's worker, or, for a turn without
idempotency key that another worker sends on to it, that worker, so that an error
there can name the turn even if the session's worker dies before answering. The
session takes such an id only if these rules read it lost as it arrives
(``Actor.new_turn_id``; else it issues one of its own, which its answer names): so
it is of the session's form, within the clocks' leeway, newer than the newest record
forgotten, and names no other turn. The rules then hold for it as for the ids of the
session's successive workers: its stamp is judged by the clock of whichever worker
answers; and one stamped by a clock that is behind may be older than records the
session drops while it waits (it reads queued: that is asked first) or once it was
lost (it then reads forgotten, as an id of a session's worker whose clock was behind
its predecessor's always could).
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import time

__all__ = [
    "CLOCK_SKEW_US",
    "MAX_TURN_ID_CHARS",
    "MAX_TURN_RECORDS",
    "new_turn_id",
    "now_us",
    "session_tag",
    "turn_id_time",
]

#: How many turn outcomes a session keeps (the most recent ones).
MAX_TURN_RECORDS = 256

#: Longer than any turn id (``turn_<tag>_<time>_<process>``, ASCII, about 40
#: characters): not one.
MAX_TURN_ID_CHARS = 200

#: How far apart the clocks of the processes that stamp a session's turn ids (its
#: workers, one after another) may be, in microseconds: an id stamped this much before
#: the session was created, or after now, was never issued for it.
CLOCK_SKEW_US = 10 * 60 * 1_000_000

_last_us = 0
_HEX = re.compile("[0-9a-f]+")
_PROCESS = secrets.token_hex(4)  # ids of two processes differ even at the same microsecond


def _reseed() -> None:
    """A forked worker must not repeat its parent's ids."""
    global _PROCESS
    _PROCESS = secrets.token_hex(4)


os.register_at_fork(after_in_child=_reseed)


def now_us() -> int:
    """Microseconds since the epoch, rising at every call in this process."""
    global _last_us
    now = time.time_ns() // 1000
    if now <= _last_us:
        now = _last_us + 1
    _last_us = now
    return now


def session_tag(session_id: str) -> str:
    """The short hash of a session's name that its turn ids carry."""
    return hashlib.blake2b(session_id.encode("utf-8"), digest_size=4).hexdigest()


def new_turn_id(tag: str) -> str:
    """A fresh turn id for the session whose tag is ``tag``, stamped now."""
    return f"turn_{tag}_{now_us():x}_{_PROCESS}"


def turn_id_time(turn_id: str, tag: str | None = None) -> int | None:
    """When ``turn_id`` was issued (as by :func:`now_us`), or None if it is not of the
    form, or (with ``tag``) not of that session."""
    parts = turn_id.split("_")
    if len(parts) != 4 or parts[0] != "turn" or (tag is not None and parts[1] != tag):
        return None
    if _HEX.fullmatch(parts[2]) is None:  # (int() would also take ' ff', '١٢', ...)
        return None
    return int(parts[2], 16)
