"""A session's metadata: the checks and the merge behind ``ref.set_metadata``.

Pure (no trio). Metadata is plain data, as the codec stores it, of at most
MAX_METADATA_BYTES encoded; a change is checked by encoding it as the event that
will journal it, so that what is refused here is exactly what the store would
refuse, before anything is written.
"""

import datetime
import math
from collections.abc import Mapping
from typing import Any, Final

import attrs

from ._codec import (
    MAX_INFO_BYTES,
    MAX_METADATA_BYTES,
    MAX_SEQ,
    dump_event,
    dump_info,
    load_event,
    metadata_size,
)
from ._errors import shown
from ._events import MetadataChanged
from ._records import SessionInfo, Status, Usage

__all__ = [
    "check_info_room",
    "check_metadata",
    "check_metadata_size",
    "merge_metadata",
    "non_finite",
    "plain_metadata",
    "replaced_keys",
]


def check_info_room(info: SessionInfo, size: int | None = None) -> None:
    """``ValueError`` naming the session if its info, which holds its metadata, could
    pass the size limit as the session lives on: checked with the fields that change
    (status, counts, usage, time) at their largest, so that no later write finds it
    too large. ``size``: the info's encoded size, if known: an info with room for the
    most those fields can grow is not encoded again."""
    if size is not None and size + _MOST_GROWTH <= MAX_INFO_BYTES:
        return
    try:
        dump_info(_largest(info))
    except ValueError as exc:
        raise ValueError(
            f"the metadata of session {info.session_id!r} leaves no room in its info, which "
            f"holds it with fields that grow as the session lives ({MAX_INFO_BYTES:,} bytes "
            "at most); keep large values out of metadata (store a reference to them)"
        ) from exc


def _largest(info: SessionInfo) -> SessionInfo:
    """``info`` with the fields that change as the session lives at their largest."""
    return attrs.evolve(
        info,
        status=Status.HIBERNATED,  # the longest status
        message_count=MAX_SEQ,
        pending_reviews=MAX_SEQ,
        usage=Usage(input_tokens=MAX_SEQ, output_tokens=MAX_SEQ),
        updated_at=info.updated_at.replace(microsecond=1),  # (a whole second packs shorter)
    )


def _most_growth() -> int:
    """The most bytes an info's encoding grows by as its changing fields reach their
    largest: from each at its smallest (the shortest status, zero counts, no usage, a
    whole second). Each field packs apart from the others, so no info grows more."""
    smallest = SessionInfo(
        session_id="s",
        agent=None,
        status=min(Status, key=lambda status: len(status.value)),
        message_count=0,
        updated_at=datetime.datetime(2000, 1, 1, tzinfo=datetime.UTC),
    )
    return len(dump_info(_largest(smallest))) - len(dump_info(smallest))


#: See ``_most_growth``.
_MOST_GROWTH: Final = _most_growth()


def check_metadata(session_id: str, metadata: object, *, stored: int = 0) -> dict[str, Any]:
    """``metadata`` as :func:`plain_metadata` gives it, if it is also at most
    MAX_METADATA_BYTES encoded; else ``TypeError`` / ``ValueError`` naming the session
    and the offending key (or the size).

    ``stored``: the encoded size of the metadata this replaces. Metadata stored before
    the limit may be larger; a change that leaves it no larger is taken, so that it
    can shrink.
    """
    plain = plain_metadata(session_id, metadata)
    check_metadata_size(session_id, metadata_size(plain), stored=stored)
    return plain


def plain_metadata(session_id: str, metadata: object) -> dict[str, Any]:
    """``metadata`` as a dict, in the form the codec reads it back, if the codec can
    store it and its floats are finite; else ``TypeError`` / ``ValueError`` naming the
    session and the offending key, or its size if it is too large for any record."""
    if not isinstance(metadata, Mapping):
        raise TypeError(
            f"metadata for session {session_id!r} must be a mapping, not {type(metadata).__name__}"
        )
    try:
        data = dump_event(MetadataChanged(session_id=session_id, seq=0, metadata=dict(metadata)))
    except (TypeError, ValueError) as exc:  # the codec's message says what is wrong, where
        try:
            size = metadata_size(metadata)
        except (TypeError, ValueError):
            size = 0
        check_metadata_size(session_id, size)  # (too large: said as the limit says it)
        raise type(exc)(f"metadata for session {session_id!r} cannot be stored: {exc}") from None
    # as the store gives it back (a tuple reads as a list): the same before and after a restart
    loaded = load_event(data, session_id=session_id)
    assert isinstance(loaded, MetadataChanged)
    problem = non_finite(loaded.metadata)
    if problem is not None:
        raise ValueError(f"metadata for session {session_id!r} cannot be stored: {problem}")
    return dict(loaded.metadata)


def check_metadata_size(session_id: str, size: int, *, stored: int = 0) -> None:
    """``ValueError`` naming the session, its size and the limit if metadata of ``size``
    bytes encoded is over MAX_METADATA_BYTES (and larger than the ``stored`` metadata it
    replaces), saying what to do."""
    if size > MAX_METADATA_BYTES and size > stored:
        raise ValueError(
            f"the metadata of session {session_id!r} is {size:,} bytes encoded, over the "
            f"limit of {MAX_METADATA_BYTES:,} (MAX_METADATA_BYTES): every listing entry "
            "carries it, and every turn writes it again; keep ids and small values in "
            "metadata (labels, flags, a URL or a key) and large data elsewhere"
        )


def non_finite(metadata: Mapping[str, Any]) -> str | None:
    """What is wrong if ``metadata`` (a session's or a message's) holds a float that is
    not finite, or None: the problem says where it sits (``metadata['key'][0]``) and
    what to do."""
    where = _non_finite(metadata, "metadata")
    if where is None:
        return None
    return (
        f"{where} is a float that is not finite (NaN or an infinity), which has no JSON "
        "form; store None or a string instead"
    )


def _non_finite(value: Any, at: str) -> str | None:
    """Where in ``value`` (at ``at``) a float that is not finite sits (``at['key'][0]``),
    or None."""
    if isinstance(value, float):
        return None if math.isfinite(value) else at
    if isinstance(value, Mapping):
        for key, item in value.items():
            found = _non_finite(item, f"{at}[{shown(key) if isinstance(key, str) else repr(key)}]")
            if found is not None:
                return found
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            found = _non_finite(item, f"{at}[{index}]")
            if found is not None:
                return found
    return None


def merge_metadata(current: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """``current`` with ``changes`` merged in: a key set to ``None`` is removed."""
    merged = dict(current)
    for key, value in changes.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = value
    return merged


def replaced_keys(current: Mapping[str, Any], changes: Mapping[str, Any]) -> tuple[str, ...]:
    """The keys of ``current`` whose value merging ``changes`` takes out: removed (set to
    ``None``) or set to another value. A value given again as it is takes nothing out."""
    return tuple(
        key
        for key, value in changes.items()
        if key in current and (value is None or not _same(current[key], value))
    )


def _same(a: Any, b: Any) -> bool:
    """Whether two plain values are the same data, of the same types (``1`` is not
    ``True`` nor ``1.0``: the store keeps them apart)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(value, b[key]) for key, value in a.items())
    if isinstance(a, list):
        return len(a) == len(b) and all(map(_same, a, b))
    return bool(a == b)
