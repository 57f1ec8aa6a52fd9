"""What a subscriber's stream must show: rising seqs, and each acknowledged turn once, whole;
and a subscriber that reads a stream to its end."""

from __future__ import annotations

import itertools
from collections import defaultdict

import sessionactors as sa


def check_stream(events: list[sa.Event], acked: dict[str, str]) -> list[str]:
    """Problems: seqs not rising, or an acknowledged turn (turn id -> reply text) not
    seen whole and once."""
    problems = []
    seqs = [e.seq for e in events]
    if any(b <= a for a, b in itertools.pairwise(seqs)):
        problems.append(f"seqs do not strictly rise: {seqs}")
    by_turn: dict[str, list[sa.Event]] = defaultdict(list)
    for event in events:
        turn_id = getattr(event, "turn_id", None)
        if turn_id is not None:
            by_turn[turn_id].append(event)
    for turn_id, text in acked.items():
        seen = by_turn.get(turn_id, [])
        kinds = [type(e).__name__ for e in seen]
        deltas = "".join(e.text for e in seen if isinstance(e, sa.Delta))
        if kinds.count("TurnStarted") != 1 or kinds.count("TurnFinished") != 1:
            problems.append(f"turn {turn_id} ({text!r}) seen as {kinds}")
        elif deltas != text:
            problems.append(f"turn {turn_id}: deltas {deltas!r}, reply {text!r}")
    return problems


def stream_problems(seqs: list[int], error: BaseException | None, finished: bool) -> list[str]:
    """What a subscriber that saw ``seqs`` and ended with ``error`` was not told: gaps, a
    lag reported at another seq, or an end without the last event."""
    problems = [f"gap {x} -> {y}" for x, y in itertools.pairwise(seqs) if y != x + 1]
    if isinstance(error, sa.SubscriberLaggedError):
        if seqs and error.last_seq != seqs[-1]:
            problems.append(f"lag reported after {error.last_seq}, last seen {seqs[-1]}")
    elif not finished:
        problems.append(f"the subscriber stopped at {seqs[-1:]} and was not told")
    return problems


def numbered_on(events: list[sa.Event], after: int) -> bool:
    """Whether the seqs of ``events`` run on by one after ``after``, but at a wake's
    status, which jumps from its ``skipped_from`` (every seq below it skipped)."""
    prev = after
    for event in events:
        start = event.seq
        if isinstance(event, sa.StatusChanged) and event.skipped_from:
            start = event.skipped_from
        if start != prev + 1:
            return False
        prev = event.seq
    return True


async def read_until_it_ends(ref: sa.SessionRef, ended: list[BaseException]) -> None:
    """Read ``ref``'s events until the subscription ends; the error that ended it."""
    try:
        async with ref.subscribe() as events:
            async for _ in events:
                pass
    except sa.SessionActorsError as exc:
        ended.append(exc)
