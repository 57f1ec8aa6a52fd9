"""Negative controls for test_durability_races.py: each broken variant must be caught.

Every case copies ``sessionactors/`` and ``tests/`` to a temporary directory, breaks one
guard of the durability code there (undoing one fix), and runs the race tests
against the copy in a subprocess: they must fail. A variant whose code has
changed fails here too, so the list is kept in step with the code.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.mutants


ROOT = Path(__file__).resolve().parent.parent
ACTOR = "sessionactors/_actor.py"
REGISTRY = "sessionactors/_registry.py"

# name: (file, the code as it is, the broken variant)
MUTANTS = {
    "deleted-crash-restarts": (
        ACTOR,
        "            if actor.deleted:  # crashed while being deleted: nothing to restart\n                _end(host, actor, _deleted_error(actor.session_id))\n                return\n",
        "",
    ),
    "no-stored_clean-after-stay-live": (
        ACTOR,
        "            self.stored_clean = True  # staying live to serve them\n",
        "",
    ),
    "settled=all-unsaved": (
        ACTOR,
        "fresh.unsaved = actor.unsaved[: actor._settled]",
        "fresh.unsaved = list(actor.unsaved)",
    ),
    "hib-emit-before-write": (
        ACTOR,
        "        await self._write_snapshot(Status.HIBERNATED)\n        if event is not None:\n            self._emit(event)",
        "        if event is not None:\n            self._emit(event)\n        await self._write_snapshot(Status.HIBERNATED)",
    ),
    "journal_status-emit-first": (
        ACTOR,
        "        event = StatusChanged(session_id=self.session_id, seq=self._seq(), status=status)\n",
        "        event = StatusChanged(session_id=self.session_id, seq=self._seq(), status=status)\n        self._emit(event)\n",
    ),
    "stop-emit-first": (
        ACTOR,
        "        self._durable(event, publish=False)\n        journal =",
        "        self._durable(event, publish=True)\n        journal =",
    ),
    "no-stop-timeout-raise": (
        ACTOR,
        "        if writing.cancelled_caught:\n            raise StoreError(",
        "        if False:\n            raise StoreError(",
    ),
    "marker-only-turn-durability": (
        ACTOR,
        "            if (\n                self.stored_clean\n",
        "            if (\n                self.stored_clean and self.host.config.durability == 'turn'\n",
    ),
    "no-marker-before-requests": (
        ACTOR,
        "            if (\n                self.stored_clean\n",
        "            if (\n                False\n",
    ),
    "no-marker-when-the-jump-falls-behind": (
        ACTOR,
        "or (self.hub is not None and self.hub.seq >= self._journal_at)",
        "or False",
    ),
    "release-before-leave": (
        ACTOR,
        "        self._leave(Status.HIBERNATED)\n        await self._release_lease()  # after leaving: a request now wakes a new actor\n        return True",
        "        await self._release_lease()\n        self._leave(Status.HIBERNATED)\n        return True",
    ),
    "no-held-reply": (
        ACTOR,
        "            if self.turn_request is not None:\n                self.held = (error, (turn_id, final, ()))\n            return\n",
        "            pass\n",
    ),
    "held-always-lost": (
        ACTOR,
        '        if not stored:\n            request.pending.set_error(_stopped_error(self.session_id, "unsaved"))',
        '        if True:\n            request.pending.set_error(_stopped_error(self.session_id, "unsaved"))',
    ),
    "end-no-stop-error": (
        ACTOR,
        "    if actor.stop_requested and not actor.deleted:  # the stop did not happen either\n        actor.stop_error = error\n",
        "",
    ),
    "crash-no-stop-error": (
        ACTOR,
        "                actor.stop_error = exc if isinstance(exc, SessionActorsError) else error",
        "                pass",
    ),
    "cancel-no-end": (
        ACTOR,
        "                _end(host, actor, cut)\n",
        "",
    ),
    "store-error-is-agents": (
        ACTOR,
        "                if exc is self.store_fault:  # our write failed, not the agent: restart\n                    raise\n",
        "",
    ),
    "jump-not-journaled-without-journal": (
        ACTOR,
        "        else:  # the journal holds only these, and the next snapshot drops them\n            session.apply(event)\n            await self.host.store.append(",
        "        elif False:\n            session.apply(event)\n            await self.host.store.append(",
    ),
    "no-deleting-guard": (REGISTRY, "        if name in self._deleting:\n", "        if False:\n"),
    "stop-ignores-stop-error": (
        REGISTRY,
        "        if actor.stop_error is not None:  # the stop did not happen (see session_task)\n            raise actor.stop_error",
        "        pass",
    ),
    "compaction-failure-fails-the-write": (
        ACTOR,
        "            with contextlib.suppress(Exception):  # the entries are stored: only compaction\n                await self._write_snapshot(self.session.status)",
        "            if True:\n                await self._write_snapshot(self.session.status)",
    ),
    "stop-compacts-inside-its-write": (
        ACTOR,
        "                await self.commit(compact=False)\n            else:\n                await self._write_snapshot(Status.STOPPED)",
        "                await self.commit()\n            else:\n                await self._write_snapshot(Status.STOPPED)",
    ),
    "only-a-plain-cancel-answers": (
        ACTOR,
        "            if _cancelled(exc):",
        "            if isinstance(exc, trio.Cancelled):",
    ),
    "any-store-error-is-a-crash": (
        ACTOR,
        "                if exc is self.store_fault:",
        "                if isinstance(exc, StoreError):",
    ),
    "stop-trusts-a-hibernated-actor": (
        REGISTRY,
        "        return actor.session.status is Status.STOPPED",
        "        return True",
    ),
    "compaction-only-forgives-store-errors": (
        ACTOR,
        "            with contextlib.suppress(Exception):  # the entries are stored: only compaction",
        "            with contextlib.suppress(StoreError):",
    ),
    "restart-while-closing-takes-requests": (
        ACTOR,
        "            if host._closing:  # it takes nothing new: it only hibernates what it has",
        "            if False:",
    ),
    "replace-leaves-late-waiters": (
        REGISTRY,
        "        _gone_event(old).set()  # a waiter may come later (ref.stop after ready())",
        "        if old.done is not None:\n            old.done.set()",
    ),
    "stop-ignores-a-deletion": (
        REGISTRY,
        "        if actor.deleted:\n            raise SessionNotFoundError(",
        "        if False:\n            raise SessionNotFoundError(",
    ),
    "stop-leaves-a-journal-tail": (
        ACTOR,
        "        if journal:  # compaction only: the stop is stored already\n",
        "        if False:\n",
    ),
}


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_the_race_tests_catch_a_broken_variant(name: str, tmp_path: Path) -> None:
    path, sound, broken = MUTANTS[name]
    shutil.copytree(ROOT / "sessionactors", tmp_path / "sessionactors")
    shutil.copytree(ROOT / "tests", tmp_path / "tests")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / path
    code = target.read_text()
    assert code.count(sound) == 1, f"{name}: the code it breaks has changed; update the variant"
    target.write_text(code.replace(sound, broken))
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/test_durability_races.py",
        ],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 1, f"{name}: the race tests did not catch it\n{run.stdout[-2000:]}"
