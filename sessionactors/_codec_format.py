"""The codec's format constants: the limits every load and dump keeps, the event
tags and the snapshot migrations (see :mod:`._codec`).
"""

from collections.abc import Callable, Mapping
from typing import Any, Final, Union

from ._events import (
    Delta,
    Event,
    HistoryEdited,
    MessageAdded,
    MetadataChanged,
    ReviewRequested,
    ReviewResolved,
    StatusChanged,
    ToolCallStarted,
    ToolResult,
    TurnCancelled,
    TurnFailed,
    TurnFinished,
    TurnStarted,
)
from ._records import MAX_COUNT

#: The largest snapshot written or read by default (64 MiB).
MAX_SNAPSHOT_BYTES: Final = 64 * 1024 * 1024
#: The largest journal entry (the events of one commit) written or read by default (16 MiB).
MAX_JOURNAL_ENTRY_BYTES: Final = 16 * 1024 * 1024
#: The same limits under their first names.
DEFAULT_MAX_SNAPSHOT_BYTES: Final = MAX_SNAPSHOT_BYTES
DEFAULT_MAX_EVENT_BYTES: Final = MAX_JOURNAL_ENTRY_BYTES
#: The largest session info written or read (it carries the session's metadata).
MAX_INFO_BYTES: Final = MAX_JOURNAL_ENTRY_BYTES
#: The largest session metadata (64 KiB), encoded as the store writes it: every
#: listing entry carries it, and every turn writes it again with the session's info.
#: Checked where a caller gives metadata (spawn, get_or_spawn, set_metadata); metadata
#: stored before the limit is read, kept and imported, within MAX_INFO_BYTES.
MAX_METADATA_BYTES: Final = 64 * 1024
#: The longest text (in characters) that one turn can carry and still be journaled:
#: UTF-8 takes at most 4 bytes a character, a turn's entry may hold its input twice
#: (``TurnStarted.text`` and the user message), and half the entry is left for the
#: reply and the rest (4 * 2 * 1 MiB = 8 MiB of the 16 MiB).
MAX_TEXT_CHARS: Final = 1024 * 1024
#: The largest value of an integer field of a record (seqs and counts; the least is 0).
MAX_SEQ: Final = MAX_COUNT
#: How deeply metadata may nest: the metadata map is level 1, a list in it level 2.
MAX_METADATA_DEPTH: Final = 32
#: Bytes of data for each map or array beyond the first FREE_CONTAINERS: decoding
#: refuses data that holds more (a Python dict costs 64 bytes or more, its msgpack
#: form one), and dumping refuses to write it. Every record's own fields take more
#: than this many bytes for each map and array they make, so only metadata can
#: reach the limit.
CONTAINER_BYTES: Final = 16
#: Maps and arrays that any data may hold whatever its size.
FREE_CONTAINERS: Final = 16384

# msgpack limits on top of the size cap: no session holds more entries in one
# array (messages) or one map (metadata), and a Timestamp is at most 12 bytes.
# Dumping checks metadata against them too; records reach the size cap first.
MAX_ARRAY_LEN: Final = 1_000_000
MAX_MAP_LEN: Final = 100_000
MAX_EXT_LEN: Final = 12

#: Migrations of the raw snapshot map: ``MIGRATIONS[n]`` turns a version ``n``
#: map into a version ``n + 1`` map. :func:`load_snapshot` applies them in turn.
MIGRATIONS: Final[dict[int, Callable[[dict[str, Any]], dict[str, Any]]]] = {
    # 2 adds SessionState.journal_mark_seq and journal_mark_events: their defaults
    # fill them in
    1: dict,
    # 3 writes a completed idempotency key by its reply's id (``reply_id``, resolved
    # against the history as the snapshot loads) rather than with its reply whole; a
    # version 2 key holds its reply whole, as before
    2: dict,
}
#: The version a snapshot is written at when none of its completed idempotency keys
#: is written by its reply's id: the format of version 2, which sessionactors that
#: read no further read too (so a session without keys writes the bytes it wrote then).
KEYS_WHOLE_VERSION: Final = 2

#: The tag of every event class in the journal. A tag, once used, is never
#: given to another class, even after its class is gone (see RETIRED_EVENT_TAGS).
EVENT_TAGS: Final[Mapping[str, type[Event]]] = {
    "turn_started": TurnStarted,
    "delta": Delta,
    "message_added": MessageAdded,
    "turn_finished": TurnFinished,
    "turn_failed": TurnFailed,
    "turn_cancelled": TurnCancelled,
    "status_changed": StatusChanged,
    "tool_call_started": ToolCallStarted,
    "tool_result": ToolResult,
    "review_requested": ReviewRequested,
    "review_resolved": ReviewResolved,
    "history_edited": HistoryEdited,
    "metadata_changed": MetadataChanged,
}
#: Tags of event classes that no longer exist: never to be used again.
RETIRED_EVENT_TAGS: Final[frozenset[str]] = frozenset()

TAG_KEY: Final = "type"
#: The first item of a journal entry in the compact form (see ``_codec_compact``): the
#: version of its layout. An entry in the map form starts with a map, or is one.
COMPACT_ENTRY: Final = 1
VERSION_KEY: Final = "schema_version"
TAG_OF: Final[dict[type[Event], str]] = {cls: tag for tag, cls in EVENT_TAGS.items()}
EVENT_UNION: Any = Union[tuple(EVENT_TAGS.values())]  # noqa: UP007 (built at runtime)
