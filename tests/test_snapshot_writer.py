"""SnapshotWriter: successive snapshots re-use packed messages, byte for byte dump_snapshot."""

from __future__ import annotations

import datetime

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sessionactors as sa
from sessionactors import _codec
from sessionactors._codec import SnapshotWriter, dump_snapshot, load_snapshot
from strategies import messages, metadata, session_states

UTC = datetime.UTC
SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# What happens to a history between two snapshots.
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(0, 20)),
        st.tuples(st.just("rewind"), st.integers(1, 10)),  # drop the newest
        st.tuples(st.just("truncate"), st.integers(1, 10)),  # drop the oldest
        st.tuples(st.just("replace"), st.integers(0, 1000)),  # an equal-looking new object
        st.tuples(st.just("metadata"), st.integers(0, 0)),
    ),
    min_size=1,
    max_size=12,
)


def fresh(template: sa.Message, n: int) -> sa.Message:
    return attrs.evolve(template, id=f"{template.id}-{n}")


def apply(history: list[sa.Message], op: str, k: int, pool: list[sa.Message]) -> None:
    if op == "append":
        history.extend(fresh(pool[i % len(pool)], len(history) + i) for i in range(k))
    elif op == "rewind":
        del history[max(0, len(history) - k) :]
    elif op == "truncate":
        del history[:k]
    elif op == "replace" and history:
        i = k % len(history)
        history[i] = attrs.evolve(history[i])  # same fields, another object


@SETTINGS
@given(
    base=session_states(),
    pool=st.lists(messages(), min_size=1, max_size=5),
    ops=OPS,
    extra=metadata(max_depth=2),
)
def test_every_snapshot_has_the_bytes_of_dump_snapshot(
    base: sa.SessionState,
    pool: list[sa.Message],
    ops: list[tuple[str, int]],
    extra: dict[str, object],
) -> None:
    """Whatever happens to the history between snapshots, the bytes are dump_snapshot's."""
    writer = SnapshotWriter(min_messages=1)
    history = list(base.messages)
    state = base
    for op, k in ops:
        apply(history, op, k, pool)
        if op == "metadata":
            state = attrs.evolve(state, metadata=extra)
        state = attrs.evolve(state, messages=tuple(history))
        assert writer.dump(state) == dump_snapshot(state)


def long_state(n: int) -> sa.SessionState:
    at = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    history = tuple(
        sa.Message(id=f"m{i}", role=sa.Role.USER, content=f"message {i}", created_at=at)
        for i in range(n)
    )
    return sa.SessionState(session_id="s", messages=history, created_at=at, updated_at=at)


def test_a_long_history_is_packed_once_and_extended() -> None:
    """Past MIN_MESSAGES the writer keeps the packed history and appends to it."""
    state = long_state(SnapshotWriter.MIN_MESSAGES + 50)
    writer = SnapshotWriter()
    assert writer.dump(state) == dump_snapshot(state)
    grown = attrs.evolve(state, messages=state.messages + long_state(70_000).messages[-3:])
    assert writer.dump(grown) == dump_snapshot(grown)  # 3 messages packed, an array16 header
    assert load_snapshot(writer.dump(grown)) == grown
    assert writer._messages is grown.messages


def test_a_short_history_keeps_nothing() -> None:
    state = long_state(SnapshotWriter.MIN_MESSAGES - 1)
    writer = SnapshotWriter()
    assert writer.dump(state) == dump_snapshot(state)
    assert writer._messages == ()
    assert writer._body == b""


def test_an_edit_of_an_old_message_is_caught_by_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: a writer that trusted the old bytes without checking the
    messages are the same objects would write a stale history; the check catches it."""
    state = long_state(SnapshotWriter.MIN_MESSAGES + 10)
    edited = list(state.messages)
    edited[5] = attrs.evolve(edited[5], content="rewritten")
    after = attrs.evolve(state, messages=tuple(edited))

    writer = SnapshotWriter()
    writer.dump(state)
    assert writer.dump(after) == dump_snapshot(after)

    monkeypatch.setattr(_codec, "_is", lambda a, b: True)  # the broken variant
    broken = SnapshotWriter()
    broken.dump(state)
    assert broken.dump(after) != dump_snapshot(after)


def test_errors_are_dump_snapshots() -> None:
    """Bad metadata and oversized output raise as dump_snapshot does; nothing is kept."""
    state = long_state(SnapshotWriter.MIN_MESSAGES)
    writer = SnapshotWriter()
    writer.dump(state)
    naive = attrs.evolve(state, metadata={"when": datetime.datetime(2026, 1, 1)})
    with pytest.raises(ValueError, match="naive datetime"):
        writer.dump(naive)
    assert writer._body == b""
    with pytest.raises(ValueError, match="over the limit"):
        writer.dump(state, max_size=100)
