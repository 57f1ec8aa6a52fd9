"""The export format: a whole session as one versioned JSON document.

Pure (no trio, no I/O). ``python -m sessionactors sessions export`` writes it and
``sessions import`` reads it (``sessions copy`` stores what it reads as import does:
``as_imported``); docs/howto/operations.md documents it. Version 1::

    {
      "format": "sessionactors.session",
      "version": 1,
      "exported_at": "2025-01-31T12:00:00+00:00",
      "session": {...},      # the whole SessionState as JSON, to read
      "snapshot": "..."      # the same state as snapshot bytes, base64: what import restores
    }

``session`` holds every field of the session's state (name, agent, status,
system prompt, summary, metadata, messages, pending reviews, idempotency keys,
the open turn, seq and counters) in the JSON forms of the HTTP gateway, for
people and tools to read. ``snapshot`` is ``sessionactors.dump_snapshot`` of
the same state: what import restores, exactly (bytes in metadata, datetimes to
the microsecond), checked by the snapshot codec (which also migrates older
snapshot versions). Import refuses a document whose ``session`` differs from
its snapshot (but for the snapshot's schema version, which the load migrates),
so a hand edit is never silently ignored. A later version adds
fields; import refuses a version newer than it knows.
"""

import base64
import binascii
import datetime
import json
from typing import Any, Final

import attrs

from ._codec import dump_snapshot, load_snapshot
from ._errors import InvalidHistoryError, SnapshotCorruptError, SnapshotVersionError
from ._history import broken_rule, check_copyable
from ._json import finite, to_json
from ._records import SessionState, Status

__all__ = ["EXPORT_FORMAT", "EXPORT_VERSION", "as_imported", "dump_export", "load_export"]

#: The ``format`` field of every export.
EXPORT_FORMAT: Final = "sessionactors.session"
#: The version written; import reads this one and older ones.
EXPORT_VERSION: Final = 1


#: Fields of the state that are the source store's bookkeeping (of its journal), not
#: the conversation: an export leaves them out, and an import starts them afresh.
_STORE_FIELDS: Final = ("journal_mark_seq", "journal_mark_events")
_FRESH: Final[dict[str, Any]] = {
    field.name: field.default for field in attrs.fields(SessionState) if field.name in _STORE_FIELDS
}


def dump_export(state: SessionState, *, exported_at: datetime.datetime) -> dict[str, Any]:
    """The export document of ``state`` (JSON-ready)."""
    state = attrs.evolve(state, **_FRESH)
    return {
        "format": EXPORT_FORMAT,
        "version": EXPORT_VERSION,
        "exported_at": exported_at.isoformat(),
        "session": _readable(state),
        "snapshot": base64.b64encode(dump_snapshot(state)).decode("ascii"),
    }


def load_export(document: Any, *, name: str | None = None) -> SessionState:
    """The state an export document holds, as a stored session to import.

    ``name`` renames it. Its status becomes ``hibernated`` (it is stored, not
    live), unless it is stopped or was never used. Raises
    ``SnapshotCorruptError`` for a document that is not a valid export,
    ``SnapshotVersionError`` for a newer version, and ``SessionBusyError`` for a
    rename of a session with a tool call still unanswered (its pending review
    would be in two sessions, as ``Registry.fork`` refuses too).
    """
    if not isinstance(document, dict) or document.get("format") != EXPORT_FORMAT:
        raise SnapshotCorruptError(
            f'this is not a sessionactors session export (no "format": {EXPORT_FORMAT!r}); '
            "pass a file written by 'python -m sessionactors sessions export'"
        )
    version = document.get("version")
    if version.__class__ is not int or version < 1:
        raise SnapshotCorruptError(f"the export's version is {version!r:.40}, not a version")
    if version > EXPORT_VERSION:
        raise SnapshotVersionError(
            f"the export is version {version}, newer than this sessionactors reads "
            f"({EXPORT_VERSION}); import it with a newer sessionactors"
        )
    snapshot = document.get("snapshot")
    try:
        data = base64.b64decode(snapshot, validate=True) if isinstance(snapshot, str) else None
    except binascii.Error:
        data = None
    if data is None:
        raise SnapshotCorruptError('the export\'s "snapshot" is not base64 text')
    state = load_snapshot(data)
    if _canonical(_versionless(_readable(state))) != _canonical(
        _versionless(document.get("session"))
    ):
        raise SnapshotCorruptError(
            f'the export of session {state.session_id!r} has a "session" that differs from '
            'its "snapshot" (edited by hand?); import restores the snapshot, so export the '
            "session again rather than editing the file",
            session_id=state.session_id,
        )
    # (a stored session may hold calls without results: waiting for a review, or cut)
    problem = broken_rule(state.messages, calls_may_wait=True)
    if problem is not None:
        raise InvalidHistoryError(
            f"the export of session {state.session_id!r} holds a history that breaks the "
            f"history rules ({problem}); nothing was written: export the session again "
            "from its store",
            session_id=state.session_id,
        )
    for review in state.reviews:  # a review names its session: never another one
        if review.session_id != state.session_id:
            raise SnapshotCorruptError(
                f"the export of session {state.session_id!r} holds review {review.id!r} "
                f"of session {review.session_id!r}; a session's reviews are its own: export "
                "the session again from its store",
                session_id=state.session_id,
            )
    if name is not None and name != state.session_id:
        # a copy: the original keeps its pending review (or its running call) as well
        check_copyable(
            state.session_id,
            state.messages,
            f"it cannot be imported under another name ({name!r}): both sessions would run "
            "the call",
            "approve or deny its review (or let its tool finish) and export it again, or "
            "import it under its own name to move it",
        )
        state = attrs.evolve(
            state,
            session_id=name,
            reviews=tuple(attrs.evolve(r, session_id=name) for r in state.reviews),
        )
    return as_imported(state)


def as_imported(state: SessionState) -> SessionState:
    """``state`` (a stored session's, as ``read_session`` reads it, or an export's) as
    import stores it: without the source store's bookkeeping of its journal, which the
    new store starts afresh, and hibernated (it is stored, not live), unless it is
    stopped or was never used. Its pending reviews and open turn stay with it (a turn
    that a process left open when it died is listed running: see ``LiveSession.info``,
    and the next request resumes it)."""
    state = attrs.evolve(state, **_FRESH)
    unused = state.status is Status.NEW and not state.messages and not state.event_seq
    if state.status is not Status.STOPPED and not unused:  # stored: no process runs it
        state = attrs.evolve(state, status=Status.HIBERNATED)
    return state


def _readable(state: SessionState) -> Any:
    readable = to_json(state)
    for name in _STORE_FIELDS:
        del readable[name]
    return readable


def _versionless(session: Any) -> Any:
    """A readable session without its snapshot's schema version, which the load migrated
    from the version the export was written at to this one's."""
    if isinstance(session, dict):
        return {key: value for key, value in session.items() if key != "schema_version"}
    return session


def _canonical(value: Any) -> str:
    # (by the rule export writes with: a float that is not finite, which metadata stored
    # before they were refused may hold, is null on both sides)
    return json.dumps(finite(value), sort_keys=True, ensure_ascii=False)
