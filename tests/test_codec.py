"""The codec: round trips, golden files that load forever, and hostile bytes."""

import copy
import datetime
import enum
import json
import re
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import cattrs
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sessionactors as sa
from sessionactors import _codec
from sessionactors._codec import (
    DEFAULT_MAX_EVENT_BYTES,
    DEFAULT_MAX_SNAPSHOT_BYTES,
    EVENT_TAGS,
    MAX_METADATA_DEPTH,
    MIGRATIONS,
    RETIRED_EVENT_TAGS,
    dump_event,
    dump_info,
    dump_snapshot,
    load_event,
    load_info,
    load_snapshot,
)
from sessionactors._records import CompletedTurn, OpenTurn
from strategies import (
    event_classes,
    events,
    messages,
    metadata,
    session_infos,
    session_states,
)

GOLDEN = Path(__file__).parent / "golden"
UTC = datetime.UTC

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ_GENERATED = settings(FUZZ, max_examples=150)
ROUND_TRIP = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
STATES = session_states()
EVENTS = events()

# -- golden records ------------------------------------------------------------------
# The files in tests/golden/ were written once by make_golden.py from these
# records. Never regenerate a file that exists: old bytes must load forever.
# snapshot_v1_minimal was written before SessionState.open_turn existed, so it
# also shows older bytes loading with a new field's default.

T_SECONDS = datetime.datetime(2025, 3, 1, 12, 0, 0, tzinfo=UTC)  # Timestamp 32
T_MICROS = datetime.datetime(2025, 3, 1, 12, 0, 1, 250001, tzinfo=UTC)  # Timestamp 64
T_BEFORE_1970 = datetime.datetime(1969, 7, 20, 20, 17, 40, 123456, tzinfo=UTC)  # Timestamp 96
T_FAR = datetime.datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC)  # Timestamp 96

_CALL = sa.ToolCall(id="call_1", name="lookup_order", arguments='{"order_id": "A1001"}')
_REFUND = sa.ToolCall(id="call_2", name="refund", arguments='{"order_id": "A1001"}')
_REPLY = sa.Message(
    id="msg_5",
    role=sa.Role.ASSISTANT,
    content="Order A1001 shipped on Monday.",
    created_at=T_MICROS,
)
_REVIEW = sa.ReviewRequest(
    id="rev_1", session_id="golden-full", tool_call=_REFUND, created_at=T_MICROS, turn_id="turn_2"
)

GOLDEN_SNAPSHOTS: dict[str, sa.SessionState] = {
    "snapshot_v1_minimal": sa.SessionState(
        session_id="golden-minimal", created_at=T_SECONDS, updated_at=T_SECONDS
    ),
    "snapshot_v1_full": sa.SessionState(
        session_id="golden-full",
        agent="support",
        status=sa.Status.WAITING,
        messages=(
            sa.Message(
                id="msg_1",
                role=sa.Role.USER,
                content="Where is order A1001? Héllo, 日本語, emoji 🎉",
                created_at=T_BEFORE_1970,
                metadata={"channel": "web"},
            ),
            sa.Message(
                id="msg_2",
                role=sa.Role.ASSISTANT,
                content="",
                created_at=T_SECONDS,
                tool_calls=(_CALL,),
            ),
            sa.Message(
                id="msg_3",
                role=sa.Role.TOOL,
                content="order service unavailable",
                created_at=T_MICROS,
                tool_call_id="call_1",
                is_error=True,
            ),
            sa.Message(
                id="msg_4",
                role=sa.Role.ASSISTANT,
                content="Let me chec",
                created_at=T_FAR,
                interrupted=True,
            ),
            _REPLY,
        ),
        metadata={
            "tenant": "acme",
            "tier": 2,
            "ratio": 0.25,
            "big": 2**64 - 1,
            "small": -(2**63),
            "flag": True,
            "none": None,
            "blob": b"\x00\xff",
            "tags": ["vip", "eu"],
            "limits": {"tokens": 6000, "nested": {"deeper": [1, [2, [3]]]}},
            "when": T_MICROS,
        },
        event_seq=41,
        created_at=T_BEFORE_1970,
        updated_at=T_MICROS,
        system_prompt="Be brief.",
        summary="The user asked about order A1001.",
        completed=(CompletedTurn(key="idem-7", turn_id="turn_1", reply=_REPLY),),
        reviews=(_REVIEW,),
        turn_count=3,
        open_turn=OpenTurn(turn_id="turn_2", idempotency_key="idem-8", started_calls=("call_2",)),
    ),
}

_SID = "golden-events"
GOLDEN_EVENTS: dict[str, sa.Event] = {
    "turn_started": sa.TurnStarted(
        session_id=_SID, seq=1, turn_id="turn_1", text="hi", idempotency_key="idem-7"
    ),
    "delta": sa.Delta(session_id=_SID, seq=2, turn_id="turn_1", text="Hel"),
    "message_added": sa.MessageAdded(session_id=_SID, seq=3, turn_id="turn_1", message=_REPLY),
    "turn_finished": sa.TurnFinished(
        session_id=_SID, seq=4, turn_id="turn_1", message=_REPLY, idempotency_key="idem-7"
    ),
    "turn_failed": sa.TurnFailed(session_id=_SID, seq=5, turn_id="turn_2", error="boom"),
    "turn_cancelled": sa.TurnCancelled(session_id=_SID, seq=6, turn_id="turn_3"),
    "status_changed": sa.StatusChanged(session_id=_SID, seq=7, status=sa.Status.HIBERNATED),
    "tool_call_started": sa.ToolCallStarted(
        session_id=_SID, seq=8, turn_id="turn_4", tool_call=_CALL
    ),
    "tool_result": sa.ToolResult(
        session_id=_SID, seq=9, turn_id="turn_4", tool_call_id="call_1", content="ok"
    ),
    "review_requested": sa.ReviewRequested(
        session_id=_SID, seq=10, turn_id="turn_4", review=_REVIEW
    ),
    "review_resolved": sa.ReviewResolved(
        session_id=_SID, seq=11, turn_id="turn_4", review_id="rev_1", approved=False, note="no"
    ),
    "history_edited": sa.HistoryEdited(
        session_id=_SID, seq=12, reason="truncate", removed=("msg_1", "msg_2"), summary="short"
    ),
    "metadata_changed": sa.MetadataChanged(
        session_id=_SID, seq=13, metadata={"tenant": "acme", "tags": ["a"]}
    ),
}

GOLDEN_INFOS: dict[str, sa.SessionInfo] = {
    "info_v1": sa.SessionInfo(
        session_id="golden-full",
        agent="support",
        status=sa.Status.IDLE,
        message_count=5,
        updated_at=T_MICROS,
        metadata={"tenant": "acme"},
        pending_reviews=1,
    ),
}


def golden_bytes(stem: str) -> bytes:
    return (GOLDEN / f"{stem}.msgpack").read_bytes()


def event_stem(tag: str) -> str:
    return f"event_{tag}"


# -- helpers -------------------------------------------------------------------------


def load_or_refuse(load: Callable[[bytes], Any], data: bytes) -> Any:
    """Load ``data``; a refusal may only be SnapshotCorruptError or SnapshotVersionError."""
    try:
        return load(data)
    except (sa.SnapshotCorruptError, sa.SnapshotVersionError):
        return None


def raw_of(data: bytes) -> dict[str, Any]:
    raw: dict[str, Any] = msgpack.unpackb(data, timestamp=3, strict_map_key=False)
    return raw


def pack(raw: object) -> bytes:
    data: bytes = msgpack.packb(raw, datetime=True)
    return data


def metadata_of_depth(levels: int) -> dict[str, Any]:
    """Metadata nested ``levels`` deep: the map itself, then lists inside it."""
    value: Any = None
    for _ in range(levels - 1):
        value = [value]
    return {"a": value}


def all_datetimes(value: Any) -> list[datetime.datetime]:
    if isinstance(value, datetime.datetime):
        return [value]
    if attrs.has(type(value)):
        value = attrs.asdict(value, recurse=False)
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list | tuple):
        return [dt for item in value for dt in all_datetimes(item)]
    return []


# -- round trips ---------------------------------------------------------------------


@ROUND_TRIP
@given(session_states())
def test_snapshot_round_trip(state: sa.SessionState) -> None:
    """Every session state loads back equal to what was dumped."""
    assert load_snapshot(dump_snapshot(state)) == state


@ROUND_TRIP
@given(events())
def test_event_round_trip(event: sa.Event) -> None:
    """Every event of every class loads back equal, as the same class."""
    loaded = load_event(dump_event(event))
    assert loaded == event
    assert type(loaded) is type(event)


@ROUND_TRIP
@given(session_infos())
def test_info_round_trip(info: sa.SessionInfo) -> None:
    """Every session info loads back equal to what was dumped."""
    assert load_info(dump_info(info)) == info


@ROUND_TRIP
@given(session_states())
def test_loaded_datetimes_are_utc(state: sa.SessionState) -> None:
    """Loading yields only timezone-aware UTC datetimes, whatever offset was dumped."""
    loaded = load_snapshot(dump_snapshot(state))
    stamps = all_datetimes(loaded)
    assert stamps
    assert all(stamp.tzinfo is UTC for stamp in stamps)


@ROUND_TRIP
@given(session_states())
def test_dump_is_deterministic(state: sa.SessionState) -> None:
    """Dumping a loaded snapshot gives the same bytes again."""
    data = dump_snapshot(state)
    assert dump_snapshot(load_snapshot(data)) == data


def test_metadata_tuples_come_back_as_lists() -> None:
    """A tuple in metadata is stored as an array and loads as a list."""
    state = attrs.evolve(GOLDEN_SNAPSHOTS["snapshot_v1_minimal"], metadata={"pair": (1, "a")})
    assert load_snapshot(dump_snapshot(state)).metadata == {"pair": [1, "a"]}


def test_metadata_at_the_depth_limit_round_trips() -> None:
    """Metadata nested exactly MAX_METADATA_DEPTH levels deep is accepted both ways."""
    state = attrs.evolve(
        GOLDEN_SNAPSHOTS["snapshot_v1_minimal"], metadata=metadata_of_depth(MAX_METADATA_DEPTH)
    )
    assert load_snapshot(dump_snapshot(state)) == state


def test_accepts_bytearray_and_memoryview() -> None:
    """Loading takes any bytes-like buffer."""
    data = golden_bytes("snapshot_v1_full")
    expected = GOLDEN_SNAPSHOTS["snapshot_v1_full"]
    assert load_snapshot(bytearray(data)) == expected  # type: ignore[arg-type]
    assert load_snapshot(memoryview(data)) == expected  # type: ignore[arg-type]


def test_refuses_text_instead_of_bytes() -> None:
    """Passing a str instead of bytes is a programming error: TypeError."""
    with pytest.raises(TypeError, match="must be bytes"):
        load_snapshot("not bytes")  # type: ignore[arg-type]


# -- golden files --------------------------------------------------------------------


@pytest.mark.parametrize("stem", sorted(GOLDEN_SNAPSHOTS))
def test_golden_snapshot_loads(stem: str) -> None:
    """Each committed v1 snapshot loads as the record it was written from."""
    assert load_snapshot(golden_bytes(stem)) == GOLDEN_SNAPSHOTS[stem]


@pytest.mark.parametrize("tag", sorted(GOLDEN_EVENTS))
def test_golden_event_loads(tag: str) -> None:
    """Each committed journal entry loads as the event it was written from."""
    assert load_event(golden_bytes(event_stem(tag))) == GOLDEN_EVENTS[tag]


@pytest.mark.parametrize("stem", sorted(GOLDEN_INFOS))
def test_golden_info_loads(stem: str) -> None:
    """Each committed session info loads as the record it was written from."""
    assert load_info(golden_bytes(stem)) == GOLDEN_INFOS[stem]


def assert_keeps(old: Any, new: Any, path: str = "$") -> None:
    """Every value in ``old`` is in ``new`` unchanged; ``new`` may add map keys."""
    if isinstance(old, dict):
        assert isinstance(new, dict), path
        for key, value in old.items():
            assert key in new, f"{path}.{key} is gone"
            assert_keeps(value, new[key], f"{path}.{key}")
    elif isinstance(old, list):
        assert isinstance(new, list), path
        assert len(new) == len(old), path
        for index, (item, new_item) in enumerate(zip(old, new, strict=True)):
            assert_keeps(item, new_item, f"{path}[{index}]")
    else:
        assert type(new) is type(old), f"{path} changed type"
        assert new == old, f"{path} changed encoding"


@pytest.mark.parametrize("stem", sorted(GOLDEN_SNAPSHOTS) + sorted(GOLDEN_INFOS))
def test_current_format_keeps_every_golden_snapshot_field(stem: str) -> None:
    """Re-dumping a golden record keeps every field's encoding; a newer format only adds fields."""
    data = golden_bytes(stem)
    if stem in GOLDEN_INFOS:
        again = dump_info(load_info(data))
    else:
        again = dump_snapshot(load_snapshot(data))
    assert_keeps(msgpack.unpackb(data), msgpack.unpackb(again))


@pytest.mark.parametrize("tag", sorted(GOLDEN_EVENTS))
def test_current_format_keeps_every_golden_event_field(tag: str) -> None:
    """Re-dumping a golden journal entry keeps its tag and every field's encoding."""
    data = golden_bytes(event_stem(tag))
    assert_keeps(msgpack.unpackb(data), msgpack.unpackb(dump_event(load_event(data))))


def test_keeps_check_catches_a_changed_encoding() -> None:
    """Negative control: assert_keeps fails when a field is removed or re-encoded."""
    old = {"a": 1, "b": [{"c": "x"}]}
    assert_keeps(old, {"a": 1, "b": [{"c": "x", "d": 2}], "e": 3})
    for changed in ({"b": [{"c": "x"}]}, {"a": "1", "b": [{"c": "x"}]}, {"a": 1, "b": []}):
        with pytest.raises(AssertionError):
            assert_keeps(old, changed)


def test_golden_events_cover_every_tag() -> None:
    """There is a golden journal entry for every event tag in use."""
    assert set(GOLDEN_EVENTS) == set(EVENT_TAGS)
    for tag, event in GOLDEN_EVENTS.items():
        assert type(event) is EVENT_TAGS[tag]


def test_golden_snapshot_layout() -> None:
    """A snapshot is a msgpack map with the version under schema_version and Timestamps."""
    raw = msgpack.unpackb(golden_bytes("snapshot_v1_full"))
    assert raw["schema_version"] == 1
    assert raw["status"] == "waiting"
    assert isinstance(raw["created_at"], msgpack.Timestamp)
    assert isinstance(raw["messages"], list)


# -- event tags ----------------------------------------------------------------------


def test_every_event_class_has_a_tag() -> None:
    """Every concrete event class has exactly one journal tag."""
    assert sorted(EVENT_TAGS.values(), key=lambda cls: cls.__name__) == event_classes()
    assert len(set(EVENT_TAGS.values())) == len(EVENT_TAGS)


def test_tags_are_explicit_names_never_reused() -> None:
    """Tags are snake_case strings, never class names, and no retired tag is back in use."""
    for tag, cls in EVENT_TAGS.items():
        assert re.fullmatch(r"[a-z]+(_[a-z]+)*", tag)
        assert tag != cls.__name__
    assert not RETIRED_EVENT_TAGS & set(EVENT_TAGS)


def test_event_tag_is_stored_under_type() -> None:
    """A journal entry holds its tag under "type" beside the event's fields."""
    raw = msgpack.unpackb(dump_event(GOLDEN_EVENTS["delta"]))
    assert raw == {
        "session_id": _SID,
        "seq": 2,
        "turn_id": "turn_1",
        "text": "Hel",
        "type": "delta",
    }


def test_dump_event_refuses_untagged_class() -> None:
    """Dumping an event class without a tag is a TypeError."""
    with pytest.raises(TypeError, match="no journal tag"):
        dump_event(sa.Event(session_id="s", seq=1))


def _record_classes() -> set[type]:
    found: set[type] = set()
    pending: list[Any] = [sa.SessionState, sa.SessionInfo, *event_classes()]
    while pending:
        cls = pending.pop()
        if cls in found:
            continue
        found.add(cls)
        for field in attrs.fields(cls):
            pending.extend(arg for arg in _type_parts(field.type) if attrs.has(arg))
    return found


def _type_parts(type_: Any) -> list[Any]:
    args = typing.get_args(type_)
    return [type_, *(part for arg in args for part in _type_parts(arg))]


def _checked_strictly(type_: Any) -> bool:
    """Whether the codec's converter has a strict hook for ``type_``."""
    origin, args = typing.get_origin(type_), typing.get_args(type_)
    if origin in (typing.Union, types.UnionType):
        return all(_checked_strictly(arg) for arg in args if arg is not type(None))
    if origin is tuple:
        return len(args) == 2 and args[1] is Ellipsis and _checked_strictly(args[0])
    if origin is Mapping:
        return args == (str, Any)
    if isinstance(type_, type) and issubclass(type_, enum.Enum):
        return True
    return type_ in {str, int, float, bool, bytes, datetime.datetime} or attrs.has(type_)


def test_every_field_type_is_checked_strictly() -> None:
    """Every field of every persisted record has a type the codec checks without coercion."""
    for cls in _record_classes():
        for field in attrs.fields(cls):
            assert _checked_strictly(field.type), f"{cls.__name__}.{field.name}: {field.type}"


# -- strictness ----------------------------------------------------------------------


class _Level(enum.Enum):
    LOW = 1


_STRICT_CASES = [
    (5, typing.Optional[str]),  # noqa: UP045 (the typing spelling must be strict too)
    (True, _Level),
    ("5", int),
    (True, int),
    (1.0, int),
    (5, str),
    (b"abc", str),
    (1, bool),
    ("no", bool),
    (5, bytes),
    (True, float),
    ("1.5", float),
    ("abc", tuple[str, ...]),
]


@pytest.mark.parametrize(("value", "type_"), _STRICT_CASES)
def test_plain_cattrs_coerces(value: object, type_: Any) -> None:
    """Negative control: a default cattrs converter coerces these values silently."""
    cattrs.Converter().structure(value, type_)


@pytest.mark.parametrize(("value", "type_"), _STRICT_CASES)
def test_codec_converter_never_coerces(value: object, type_: Any) -> None:
    """The codec's converter refuses a value of the wrong type instead of converting it."""
    with pytest.raises((ValueError, cattrs.BaseValidationError)):
        _codec._CONVERTER.structure(value, type_)


def test_int_is_accepted_for_float() -> None:
    """An integer is a valid float and is structured as a float."""
    result = _codec._CONVERTER.structure(3, float)
    assert result == 3.0
    assert type(result) is float


# -- corrupt and hostile input -------------------------------------------------------


def test_harness_does_not_swallow_other_errors() -> None:
    """Negative control: load_or_refuse lets through any error but the two codec errors."""
    truncated = golden_bytes("snapshot_v1_full")[:-1]
    with pytest.raises(ValueError, match="incomplete"):
        load_or_refuse(msgpack.unpackb, truncated)


@pytest.mark.parametrize("stem", sorted(GOLDEN_SNAPSHOTS))
def test_every_truncated_snapshot_is_corrupt(stem: str) -> None:
    """Every proper prefix of a snapshot raises SnapshotCorruptError."""
    data = golden_bytes(stem)
    for end in range(len(data)):
        with pytest.raises(sa.SnapshotCorruptError):
            load_snapshot(data[:end])


@pytest.mark.parametrize("tag", sorted(GOLDEN_EVENTS))
def test_every_truncated_event_is_corrupt(tag: str) -> None:
    """Every proper prefix of a journal entry raises SnapshotCorruptError."""
    data = golden_bytes(event_stem(tag))
    for end in range(len(data)):
        with pytest.raises(sa.SnapshotCorruptError):
            load_event(data[:end])


@pytest.mark.parametrize("garbage", [b"\x00", b"\xc0", b"\x81\xa1a\x01", b"\xff" * 10])
def test_trailing_garbage_is_corrupt(garbage: bytes) -> None:
    """Bytes after a complete snapshot make it corrupt."""
    with pytest.raises(sa.SnapshotCorruptError, match="extra bytes"):
        load_snapshot(golden_bytes("snapshot_v1_full") + garbage)


def test_oversized_snapshot_is_refused_before_parsing() -> None:
    """A snapshot over max_size is refused with its size and the limit, before msgpack runs."""
    data = golden_bytes("snapshot_v1_full")
    assert load_snapshot(data, max_size=len(data)) == GOLDEN_SNAPSHOTS["snapshot_v1_full"]
    with pytest.raises(sa.SnapshotCorruptError) as info:
        load_snapshot(data, max_size=len(data) - 1, session_id="big")
    assert f"{len(data)} bytes" in str(info.value)
    assert f"limit of {len(data) - 1} bytes" in str(info.value)
    with pytest.raises(sa.SnapshotCorruptError, match="over the limit"):
        load_snapshot(b"\xc1" * (DEFAULT_MAX_SNAPSHOT_BYTES + 1))


def test_oversized_event_is_refused() -> None:
    """A journal entry over max_size is refused, by default at DEFAULT_MAX_EVENT_BYTES."""
    data = golden_bytes(event_stem("delta"))
    with pytest.raises(sa.SnapshotCorruptError, match="over the limit"):
        load_event(data, max_size=len(data) - 1)
    with pytest.raises(sa.SnapshotCorruptError, match="over the limit"):
        load_event(b"\xc1" * (DEFAULT_MAX_EVENT_BYTES + 1))


def full_raw() -> dict[str, Any]:
    return raw_of(golden_bytes("snapshot_v1_full"))


@pytest.mark.parametrize("version", [2, 3, 2**40])
def test_future_schema_version_asks_to_upgrade(version: int) -> None:
    """A snapshot from a newer sessionactors raises SnapshotVersionError saying to upgrade."""
    raw = full_raw()
    raw["schema_version"] = version
    with pytest.raises(sa.SnapshotVersionError, match="upgrade") as info:
        load_snapshot(pack(raw))
    assert info.value.session_id == "golden-full"
    assert "golden-full" in str(info.value)


@pytest.mark.parametrize("version", [0, -1, "1", 1.0, True, None, [1]])
def test_wrong_schema_version_is_corrupt(version: object) -> None:
    """A schema_version that is not a positive integer makes the snapshot corrupt."""
    raw = full_raw()
    raw["schema_version"] = version
    with pytest.raises(sa.SnapshotCorruptError, match="schema_version"):
        load_snapshot(pack(raw))


def test_missing_schema_version_is_corrupt() -> None:
    """A snapshot without schema_version is corrupt."""
    raw = full_raw()
    del raw["schema_version"]
    with pytest.raises(sa.SnapshotCorruptError, match="schema_version is missing"):
        load_snapshot(pack(raw))


@pytest.mark.parametrize("data", [pack([1, 2]), pack("text"), pack(None), pack(5)])
def test_top_level_must_be_a_map(data: bytes) -> None:
    """A snapshot, journal entry or info that is not a msgpack map is corrupt."""
    for load in (load_snapshot, load_event, load_info):
        with pytest.raises(sa.SnapshotCorruptError, match="expected a map"):
            load(data)


def _set(path: tuple[Any, ...], value: object) -> Callable[[dict[str, Any]], None]:
    def mutate(raw: dict[str, Any]) -> None:
        target: Any = raw
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return mutate


def _delete(path: tuple[Any, ...]) -> Callable[[dict[str, Any]], None]:
    def mutate(raw: dict[str, Any]) -> None:
        target: Any = raw
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]

    return mutate


_WRONG_FIELDS = {
    "str for int": _set(("event_seq",), "5"),
    "bool for int": _set(("turn_count",), True),
    "float for int": _set(("event_seq",), 5.0),
    "int for str": _set(("messages", 0, "id"), 5),
    "int for optional str": _set(("agent",), 5),
    "unknown status": _set(("status",), "sleeping"),
    "int for status": _set(("status",), 1),
    "str for tuple": _set(("messages",), "abc"),
    "map for tuple": _set(("messages",), {"a": 1}),
    "str for message": _set(("messages", 0), "hello"),
    "bytes for str": _set(("messages", 0, "content"), b"hello"),
    "int for bool": _set(("messages", 2, "is_error"), 1),
    "unknown role": _set(("messages", 0, "role"), "robot"),
    "float for timestamp": _set(("messages", 0, "created_at"), 1_700_000_000.0),
    "str for timestamp": _set(("created_at",), "2025-01-01T00:00:00Z"),
    "int for tool call": _set(("messages", 1, "tool_calls"), [5]),
    "array for metadata": _set(("metadata",), [1, 2]),
    "bytes metadata key": _set(("metadata",), {b"key": 1}),
    "nested bytes metadata key": _set(("metadata",), {"a": [{b"key": 1}]}),
    "metadata too deep": _set(("metadata",), metadata_of_depth(MAX_METADATA_DEPTH + 1)),
    "int for review": _set(("reviews", 0), 7),
    "str for optional record": _set(("open_turn",), "turn_2"),
    "int in a tuple of str": _set(("open_turn", "started_calls"), [5]),
    "missing field": _delete(("created_at",)),
    "missing nested field": _delete(("messages", 0, "content")),
    "ext type in a field": _set(("summary",), msgpack.ExtType(5, b"x")),
    "ext type in metadata": _set(("metadata", "blob"), msgpack.ExtType(0, b"")),
}


@pytest.mark.parametrize("case", sorted(_WRONG_FIELDS))
def test_wrong_field_is_corrupt(case: str) -> None:
    """A field of the wrong type or shape makes the snapshot corrupt, naming the session."""
    raw = full_raw()
    _WRONG_FIELDS[case](raw)
    with pytest.raises(sa.SnapshotCorruptError) as info:
        load_snapshot(pack(raw))
    assert info.value.session_id == "golden-full"
    assert "registry.delete('golden-full')" in str(info.value)


def test_corrupt_message_names_the_field() -> None:
    """The error says which field is wrong and how."""
    raw = full_raw()
    raw["messages"][2]["content"] = 7
    with pytest.raises(
        sa.SnapshotCorruptError, match=r"expected a string, got int @ \$\.messages\[2\]\.content"
    ):
        load_snapshot(pack(raw))


def test_corrupt_error_prefers_the_callers_session_id() -> None:
    """The session_id argument names the session even when the data names another."""
    raw = full_raw()
    raw["event_seq"] = "5"
    with pytest.raises(sa.SnapshotCorruptError) as info:
        load_snapshot(pack(raw), session_id="mine")
    assert info.value.session_id == "mine"
    assert "session 'mine'" in str(info.value)
    assert "registry.delete('mine')" in str(info.value)


def test_corrupt_error_without_a_name_says_what_to_do() -> None:
    """Unreadable bytes with no session_id still say how to recover."""
    with pytest.raises(sa.SnapshotCorruptError, match=r"unknown session .*registry\.delete"):
        load_snapshot(b"\xc1")


def test_corrupt_error_keeps_the_cause() -> None:
    """The original decoding error is kept as __cause__."""
    with pytest.raises(sa.SnapshotCorruptError) as info:
        load_snapshot(golden_bytes("snapshot_v1_full")[:10])
    assert isinstance(info.value.__cause__, ValueError)


@pytest.mark.parametrize(
    "ext",
    [
        msgpack.packb(msgpack.ExtType(42, b"payload")),
        b"\xd6\xff\x00",  # a Timestamp of the wrong length, cut short
        b"\xc7\x03\xff\x00\x00\x00",  # a Timestamp of the wrong length
        b"\xc7\x0c\xff" + b"\x00" * 4 + (2**62).to_bytes(8, "big"),  # beyond datetime
        b"\xc7\x0d\x05" + b"\x00" * 13,  # longer than any Timestamp
    ],
)
def test_extension_types_are_corrupt(ext: bytes) -> None:
    """msgpack extensions other than a valid Timestamp make the snapshot corrupt."""
    raw = full_raw()
    del raw["summary"]
    data = _append_raw_entry(raw, "summary", ext)
    with pytest.raises(sa.SnapshotCorruptError):
        load_snapshot(data)


def _append_raw_entry(raw: dict[str, Any], key: str, encoded_value: bytes) -> bytes:
    """Pack ``raw`` plus one more entry whose value is given as msgpack bytes."""
    size = len(raw) + 1
    header = bytes([0x80 | size]) if size < 16 else b"\xde" + size.to_bytes(2, "big")
    body = b"".join(pack(k) + pack(v) for k, v in raw.items())
    return header + body + pack(key) + encoded_value


@pytest.mark.parametrize("lists", [MAX_METADATA_DEPTH, 200, 5_000, 200_000])
def test_deep_nesting_is_corrupt(lists: int) -> None:
    """Arrays nested past the metadata limit, even past msgpack's own, make a snapshot corrupt."""
    raw = full_raw()
    del raw["metadata"]
    deep = b"\x81\xa1x" + b"\x91" * lists + b"\xc0"
    with pytest.raises(sa.SnapshotCorruptError, match="nested"):
        load_snapshot(_append_raw_entry(raw, "metadata", deep))


def test_only_the_first_wrong_element_is_reported() -> None:
    """A long array of wrong values is reported by its first element, without the rest."""
    raw = full_raw()
    raw["messages"] = [5] * 100_000
    with pytest.raises(sa.SnapshotCorruptError, match=r"@ \$\.messages\[0\];") as info:
        load_snapshot(pack(raw))
    assert "; ..." not in str(info.value)


def test_deep_nesting_outside_metadata_is_corrupt() -> None:
    """Deep nesting where a string is expected is refused without recursing into it."""
    raw = full_raw()
    del raw["summary"]
    deep = b"\x91" * 900 + b"\xc0"
    with pytest.raises(sa.SnapshotCorruptError, match="summary"):
        load_snapshot(_append_raw_entry(raw, "summary", deep))


def test_invalid_utf8_is_corrupt() -> None:
    """A string that is not UTF-8 makes the snapshot corrupt."""
    raw = full_raw()
    del raw["summary"]
    with pytest.raises(sa.SnapshotCorruptError, match="UTF-8"):
        load_snapshot(_append_raw_entry(raw, "summary", b"\xa2\xff\xfe"))


def _event_raw(tag: str) -> dict[str, Any]:
    return raw_of(golden_bytes(event_stem(tag)))


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (_set(("type",), "turn_exploded"), "unknown event type 'turn_exploded'"),
        (_set(("type",), "TurnStarted"), "unknown event type"),
        (_set(("type",), ["delta"]), "event type is missing"),
        (_set(("type",), 3), "event type is missing"),
        (_delete(("type",)), "event type is missing"),
        (_set(("seq",), "4"), r"expected an integer, got str @ \$\.seq"),
        (_set(("message", "role"), "robot"), "not a Role value"),
    ],
)
def test_wrong_event_is_corrupt(mutate: Callable[[dict[str, Any]], None], match: str) -> None:
    """An unknown or missing tag, or a wrong field, makes a journal entry corrupt."""
    raw = _event_raw("turn_finished")
    mutate(raw)
    with pytest.raises(sa.SnapshotCorruptError, match=match) as info:
        load_event(pack(raw))
    assert info.value.session_id == _SID


@pytest.mark.parametrize(
    ("load", "stem", "mutate"),
    [
        (load_snapshot, "snapshot_v1_full", _set(("colour",), "blue")),
        (load_snapshot, "snapshot_v1_full", _set(("messages", 0, "colour"), "blue")),
        (load_snapshot, "snapshot_v1_full", _set(("reviews", 0, "tool_call", "colour"), 1)),
        (load_event, event_stem("turn_finished"), _set(("colour",), "blue")),
        (load_event, event_stem("turn_finished"), _set(("type",), "turn_cancelled")),
        (load_info, "info_v1", _set(("colour",), "blue")),
    ],
)
def test_unknown_fields_ask_to_upgrade(
    load: Callable[[bytes], Any], stem: str, mutate: Callable[[dict[str, Any]], None]
) -> None:
    """Fields this version does not know raise SnapshotVersionError: a newer version wrote them."""
    raw = raw_of(golden_bytes(stem))
    mutate(raw)
    with pytest.raises(sa.SnapshotVersionError, match=r"colour|message.*upgrade") as info:
        load(pack(raw))
    assert "upgrade" in str(info.value)
    assert info.value.session_id is not None


def test_unknown_and_wrong_fields_are_corrupt() -> None:
    """An unknown field beside a wrongly typed one makes the snapshot corrupt, not newer."""
    raw = full_raw()
    raw["colour"] = "blue"
    raw["messages"][0]["content"] = 5
    with pytest.raises(sa.SnapshotCorruptError, match="expected a string"):
        load_snapshot(pack(raw))


def test_wrong_info_is_corrupt() -> None:
    """A session info with a wrong field is corrupt and names the session."""
    raw = raw_of(golden_bytes("info_v1"))
    raw["message_count"] = "5"
    with pytest.raises(sa.SnapshotCorruptError, match="golden-full"):
        load_info(pack(raw))


# -- fuzzing -------------------------------------------------------------------------

_LOADERS: dict[str, Callable[[bytes], Any]] = {
    "snapshot": load_snapshot,
    "event": load_event,
    "info": load_info,
}
_GOLDEN_STEMS = sorted(GOLDEN_SNAPSHOTS) + [event_stem(tag) for tag in sorted(GOLDEN_EVENTS)]


def _loader_for(stem: str) -> Callable[[bytes], Any]:
    return load_snapshot if stem.startswith("snapshot") else load_event


def _check_reloads(loaded: Any) -> None:
    """Whatever loads can be dumped again and reloads to the same bytes."""
    if isinstance(loaded, sa.SessionState):
        again = dump_snapshot(loaded)
        assert dump_snapshot(load_snapshot(again)) == again
    elif isinstance(loaded, sa.Event):
        again = dump_event(loaded)
        assert dump_event(load_event(again)) == again
    elif isinstance(loaded, sa.SessionInfo):
        again = dump_info(loaded)
        assert dump_info(load_info(again)) == again


@FUZZ
@given(st.sampled_from(sorted(_LOADERS)), st.binary(max_size=2000))
def test_arbitrary_bytes_load_or_refuse(kind: str, data: bytes) -> None:
    """Arbitrary bytes either load or raise one of the two codec errors."""
    _check_reloads(load_or_refuse(_LOADERS[kind], data))


@FUZZ
@given(st.sampled_from(_GOLDEN_STEMS), st.data())
def test_bit_flips_load_or_refuse(stem: str, data: st.DataObject) -> None:
    """A golden file with one to three flipped bits loads or raises a codec error."""
    buffer = bytearray(golden_bytes(stem))
    for bit in data.draw(st.lists(st.integers(0, len(buffer) * 8 - 1), min_size=1, max_size=3)):
        buffer[bit // 8] ^= 1 << (bit % 8)
    _check_reloads(load_or_refuse(_loader_for(stem), bytes(buffer)))


def _mutations(data: bytes) -> st.SearchStrategy[bytes]:
    size = len(data)
    position = st.integers(0, size)
    return st.one_of(
        st.tuples(position, st.binary(min_size=1, max_size=8)).map(
            lambda pair: data[: pair[0]] + pair[1] + data[pair[0] :]
        ),
        st.tuples(position, st.integers(1, 16)).map(
            lambda pair: data[: pair[0]] + data[pair[0] + pair[1] :]
        ),
        st.tuples(position, st.binary(min_size=1, max_size=4)).map(
            lambda pair: data[: pair[0]] + pair[1] + data[pair[0] + len(pair[1]) :]
        ),
    )


@FUZZ_GENERATED
@given(st.data())
def test_mutated_snapshots_load_or_refuse(data: st.DataObject) -> None:
    """A snapshot with bytes inserted, deleted or overwritten loads or raises a codec error."""
    encoded = dump_snapshot(data.draw(STATES))
    mutated = data.draw(_mutations(encoded))
    _check_reloads(load_or_refuse(load_snapshot, mutated))


@FUZZ_GENERATED
@given(st.data())
def test_mutated_events_load_or_refuse(data: st.DataObject) -> None:
    """A journal entry with bytes inserted, deleted or overwritten loads or raises a codec error."""
    encoded = dump_event(data.draw(EVENTS))
    mutated = data.draw(_mutations(encoded))
    _check_reloads(load_or_refuse(load_event, mutated))


_ANY_MSGPACK: st.SearchStrategy[Any] = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**64 - 1),
        st.floats(),
        st.text(max_size=10),
        st.binary(max_size=10),
        st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=4)),
        st.builds(msgpack.Timestamp, st.integers(-(2**40), 2**40), st.integers(0, 999_999_999)),
    ),
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(st.text(max_size=6) | st.binary(max_size=3), children, max_size=3)
    ),
    max_leaves=8,
)


def _slots(value: Any, out: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """Every (container, key) place in a decoded msgpack tree."""
    if isinstance(value, dict):
        for key in value:
            out.append((value, key))
            _slots(value[key], out)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            out.append((value, index))
            _slots(item, out)
    return out


@FUZZ_GENERATED
@given(st.data())
def test_replaced_values_load_or_refuse(data: st.DataObject) -> None:
    """Any value put anywhere in a valid snapshot or event loads or raises a codec error."""
    if data.draw(st.booleans()):
        load: Callable[[bytes], Any] = load_snapshot
        raw = raw_of(dump_snapshot(data.draw(STATES)))
    else:
        load = load_event
        raw = raw_of(dump_event(data.draw(EVENTS)))
    container, key = data.draw(st.sampled_from(_slots(raw, [])))
    container[key] = data.draw(_ANY_MSGPACK)
    _check_reloads(load_or_refuse(load, pack(raw)))


# -- dumping -------------------------------------------------------------------------

_NAIVE = datetime.datetime(2025, 1, 1, 12, 0)
_MINIMAL = GOLDEN_SNAPSHOTS["snapshot_v1_minimal"]


@pytest.mark.parametrize(
    "state",
    [
        attrs.evolve(_MINIMAL, created_at=_NAIVE),
        attrs.evolve(_MINIMAL, updated_at=_NAIVE),
        attrs.evolve(_MINIMAL, messages=(attrs.evolve(_REPLY, created_at=_NAIVE),)),
        attrs.evolve(_MINIMAL, reviews=(attrs.evolve(_REVIEW, created_at=_NAIVE),)),
        attrs.evolve(_MINIMAL, metadata={"when": _NAIVE}),
    ],
)
def test_naive_datetime_is_refused_on_dump(state: sa.SessionState) -> None:
    """Dumping a naive datetime anywhere raises ValueError naming the session."""
    with pytest.raises(ValueError, match=r"golden-minimal.*naive datetime"):
        dump_snapshot(state)


def test_naive_datetime_in_event_is_refused() -> None:
    """Dumping an event holding a naive datetime raises ValueError."""
    event = sa.MessageAdded(session_id="s", seq=1, message=attrs.evolve(_REPLY, created_at=_NAIVE))
    with pytest.raises(ValueError, match="naive datetime"):
        dump_event(event)


@pytest.mark.parametrize(
    ("meta", "error", "match"),
    [
        ({1: "one"}, TypeError, "keys must be str"),
        ({"a": {b"k": 1}}, TypeError, "keys must be str"),
        ({"a": {1, 2}}, TypeError, "set"),
        ({"a": object()}, TypeError, "object"),
        (metadata_of_depth(MAX_METADATA_DEPTH + 1), ValueError, "nested deeper"),
        ({"a": 2**64}, ValueError, "64-bit"),
        ({"a": -(2**63) - 1}, ValueError, "64-bit"),
        ({"a": "\ud800"}, ValueError, "surrogate"),
        ({"a": dict.fromkeys(map(str, range(100_001)), 0)}, ValueError, "more than 100000"),
        ({"a": [0] * 1_000_001}, ValueError, "more than 1000000"),
    ],
)
def test_unencodable_metadata_is_refused(meta: dict[Any, Any], error: type, match: str) -> None:
    """Metadata that is not plain msgpack data is refused on dump with the session named."""
    with pytest.raises(error, match=match) as info:
        dump_snapshot(attrs.evolve(_MINIMAL, metadata=meta))
    assert "golden-minimal" in str(info.value)


def test_a_value_that_is_not_the_enum_is_refused() -> None:
    """An enum field holding its value (or anything else) is a TypeError naming the
    session, in journal entries and snapshots alike."""
    wrong = attrs.evolve(_REPLY, role="assistant")
    with pytest.raises(TypeError, match="'assistant' is not a Role") as info:
        dump_event(sa.MessageAdded(session_id="s", seq=1, message=wrong))
    assert "'s'" in str(info.value)
    for status in ("idle", ["idle"]):  # a value, and one that cannot even be looked up
        with pytest.raises(TypeError, match="golden-minimal"):
            dump_snapshot(attrs.evolve(_MINIMAL, status=status))
    with pytest.raises(TypeError, match="'idle' is not a Status"):
        dump_snapshot(attrs.evolve(_MINIMAL, status="idle"))


def test_dump_refuses_other_schema_versions() -> None:
    """A state claiming another schema version is not written as version 1."""
    with pytest.raises(ValueError, match="schema_version 2"):
        dump_snapshot(attrs.evolve(_MINIMAL, schema_version=2))


def test_dump_refuses_output_over_the_limit() -> None:
    """Dumping more than max_size bytes raises ValueError rather than write what cannot load."""
    with pytest.raises(ValueError, match="over the limit"):
        dump_snapshot(GOLDEN_SNAPSHOTS["snapshot_v1_full"], max_size=100)
    with pytest.raises(ValueError, match="over the limit"):
        dump_event(GOLDEN_EVENTS["turn_finished"], max_size=10)


def test_dump_refuses_other_types() -> None:
    """dump_snapshot and dump_info take only their own record type."""
    with pytest.raises(TypeError):
        dump_snapshot(GOLDEN_INFOS["info_v1"])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        dump_info(_MINIMAL)  # type: ignore[arg-type]


@ROUND_TRIP
@given(messages(), metadata(max_depth=2))
def test_message_metadata_round_trips_in_events(message: sa.Message, meta: Any) -> None:
    """Metadata inside a message survives a journal round trip."""
    event = sa.MessageAdded(session_id="s", seq=1, message=attrs.evolve(message, metadata=meta))
    assert load_event(dump_event(event)) == event


# -- migrations ----------------------------------------------------------------------


def test_migrations_run_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """An older snapshot goes through every migration up to the current version."""
    seen: list[int] = []

    def v1_to_v2(raw: dict[str, Any]) -> dict[str, Any]:
        seen.append(raw["schema_version"])
        return {**raw, "summary": "migrated"}

    def v2_to_v3(raw: dict[str, Any]) -> dict[str, Any]:
        seen.append(raw["schema_version"])
        return {**raw, "turn_count": raw["turn_count"] + 1}

    monkeypatch.setattr(_codec, "SCHEMA_VERSION", 3)
    monkeypatch.setitem(MIGRATIONS, 1, v1_to_v2)
    monkeypatch.setitem(MIGRATIONS, 2, v2_to_v3)
    loaded = load_snapshot(golden_bytes("snapshot_v1_full"))
    assert seen == [1, 2]
    expected = GOLDEN_SNAPSHOTS["snapshot_v1_full"]
    assert loaded == attrs.evolve(
        expected, schema_version=3, summary="migrated", turn_count=expected.turn_count + 1
    )


def test_missing_migration_is_a_version_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """An older version with no migration path raises SnapshotVersionError."""
    monkeypatch.setattr(_codec, "SCHEMA_VERSION", 2)
    with pytest.raises(sa.SnapshotVersionError, match="cannot migrate"):
        load_snapshot(golden_bytes("snapshot_v1_full"))


def test_failing_migration_is_corrupt(monkeypatch: pytest.MonkeyPatch) -> None:
    """A migration that fails on the data makes the snapshot corrupt, keeping the cause."""

    def broken(raw: dict[str, Any]) -> dict[str, Any]:
        return {**raw, "x": raw["no such key"]}

    monkeypatch.setattr(_codec, "SCHEMA_VERSION", 2)
    monkeypatch.setitem(MIGRATIONS, 1, broken)
    with pytest.raises(sa.SnapshotCorruptError, match="migrating from version 1") as info:
        load_snapshot(golden_bytes("snapshot_v1_full"))
    assert isinstance(info.value.__cause__, KeyError)


def test_no_migrations_today() -> None:
    """Version 1 is the first format, so there is nothing to migrate yet."""
    assert MIGRATIONS == {}


def test_messages_without_metadata_share_one_read_only_mapping() -> None:
    """No empty dict per message: one shared mapping, which refuses changes and
    otherwise behaves as an empty dict (equality, JSON, copies, the codec)."""
    a = sa.Message.create(sa.Role.USER, "a")
    b = sa.Message.create(sa.Role.ASSISTANT, "b")
    assert a.metadata is b.metadata
    assert a.metadata == {}
    assert isinstance(a.metadata, dict)
    for change in (
        lambda m: m.__setitem__("k", 1),
        lambda m: m.update(k=1),
        lambda m: m.setdefault("k", 1),
        lambda m: m.pop("k", None),
        lambda m: m.clear(),
    ):
        with pytest.raises(TypeError, match="read-only"):
            change(a.metadata)
    assert a.metadata == {}
    assert json.dumps(a.metadata) == "{}"
    assert type(copy.copy(a.metadata)) is dict
    assert type(copy.deepcopy(a.metadata)) is dict
    assert attrs.asdict(a)["metadata"] == {}
    # an empty map decodes to it; the bytes are those of an empty dict
    event = sa.MessageAdded(session_id="s", seq=1, message=a)
    assert dump_event(event) == dump_event(
        attrs.evolve(event, message=attrs.evolve(a, metadata={}))
    )
    loaded = load_event(dump_event(event))
    assert isinstance(loaded, sa.MessageAdded)
    assert loaded == event
    assert loaded.message.metadata is a.metadata
    # metadata given is the caller's own, as before
    given_meta = {"k": 1}
    assert attrs.evolve(a, metadata=given_meta).metadata is given_meta
