"""The durability checks hold over sound stores and catch every broken store of the test kit.

A check that passes proves something only if it fails when the promise it checks
is broken: each flaw of ``FlawedStore`` breaks one promise of the store, and the
checks named for it in ``CAUGHT`` must fail over it (the negative controls).
"""

from __future__ import annotations

import pytest
import trio

from durability_checks import CHECKS, Wrap, as_is
from sessionactors.stores import Store
from sessionactors.testing import FaultyStore, FlawedStore

#: Each flaw, and the checks that must catch it.
CAUGHT: dict[str, list[str]] = {
    "lose_appends": [
        "acknowledged turns survive a death",
        "a death after a clean wake reuses no seq",
    ],
    "ack_appends_early": [
        "acknowledged turns survive a death",
        "a death after a clean wake reuses no seq",
    ],
    "lose_snapshots": [
        "a hibernated session wakes whole",
        "a hibernated session wakes whole (durability=hibernate)",
        "compaction keeps every turn",
    ],
    "reorder_journal": ["acknowledged turns survive a death"],
    "ignore_fences": ["a stale owner cannot stop the session"],
    "ignore_leases": [
        "a stale owner cannot stop the session",
        "a session leased by one worker is busy for another",
    ],
    "cut_values": ["a long message survives a death"],
    "text_values": ["a long message survives a death"],
}


def faulty(disk: Store) -> Store:
    """A FaultyStore with no fault planned: sound."""
    return FaultyStore(disk)


def flawed(flaw: str) -> Wrap:
    def wrap(disk: Store) -> Store:
        return FlawedStore(flaw, disk)

    return wrap


@pytest.mark.parametrize("wrap", [as_is, faulty], ids=["MemoryStore", "FaultyStore"])
@pytest.mark.parametrize("check", sorted(CHECKS))
async def test_a_check_passes_over_a_sound_store(
    check: str, wrap: Wrap, autojump_clock: trio.abc.Clock
) -> None:
    """Each durability check holds over a MemoryStore, bare or in a FaultyStore without faults."""
    await CHECKS[check](wrap)


@pytest.mark.parametrize(
    ("flaw", "check"), [(flaw, check) for flaw, checks in CAUGHT.items() for check in checks]
)
async def test_a_check_fails_over_a_flawed_store(
    flaw: str, check: str, autojump_clock: trio.abc.Clock
) -> None:
    """The durability check fails over a store with the flaw it is meant to catch."""
    with pytest.raises(AssertionError):
        await CHECKS[check](flawed(flaw))


def test_every_flaw_is_caught_and_every_check_catches_one() -> None:
    """Each flaw has a check that catches it, and each check is shown to catch a flaw."""
    assert set(CAUGHT) == set(FlawedStore.FLAWS)
    assert {check for checks in CAUGHT.values() for check in checks} == set(CHECKS)
