"""The history rules the tests check against, written apart from the library's own.

A "tool group" is an assistant message with tool calls and the tool messages that
answer them, right after it. Every edit of a history keeps or drops a group whole.
"""

from __future__ import annotations

from collections.abc import Sequence

import sessionactors as sa


def tool_pairs_intact(messages: Sequence[sa.Message]) -> bool:
    """Whether every tool result follows its call at once and every call has its result."""
    waiting: set[str] = set()
    for message in messages:
        if message.role is sa.Role.TOOL:
            if message.tool_call_id not in waiting:
                return False  # no call asked for it, or it was answered already
            waiting.remove(message.tool_call_id)
            continue
        if waiting:
            return False  # something came between a call and its results
        if message.role is sa.Role.ASSISTANT and message.tool_calls:
            waiting = {call.id for call in message.tool_calls}
    return not waiting


def groups(messages: Sequence[sa.Message]) -> list[range]:
    """The history cut into its indivisible parts: a tool group, or a single message."""
    parts: list[range] = []
    start = 0
    for i, message in enumerate(messages):
        if message.role is sa.Role.TOOL and i > 0 and parts and parts[-1].stop == i:
            first = messages[parts[-1].start]
            if first.role is sa.Role.ASSISTANT and first.tool_calls:
                parts[-1] = range(parts[-1].start, i + 1)  # the group goes on
                start = i + 1
                continue
        parts.append(range(i, i + 1))
        start = i + 1
    assert start == len(messages)
    return parts


def kept_by_truncate(messages: Sequence[sa.Message], keep_last: int) -> list[sa.Message]:
    """``truncate(keep_last)``: at least the last ``keep_last`` messages, from the user
    message that began the turn the cut falls in; with no user message at or before the
    cut, from the start of its tool group."""
    if keep_last <= 0:
        return []
    cut = max(0, len(messages) - keep_last)
    users = [i for i, m in enumerate(messages) if m.role is sa.Role.USER and i <= cut]
    if users:
        return list(messages[users[-1] :])
    for part in groups(messages):
        if cut in part:
            cut = part.start
            break
    return list(messages[cut:])


def kept_by_rewind(messages: Sequence[sa.Message], index: int) -> list[sa.Message]:
    """``rewind(messages[index].id)``: the history up to that message, and the rest of its
    tool group when it is in one."""
    for part in groups(messages):
        if index in part:
            return list(messages[: part.stop])
    raise IndexError(index)


def kept_by_compaction(messages: Sequence[sa.Message], keep_last: int) -> list[sa.Message]:
    """What a compaction keeps of ``messages`` (the turn's new user message last): the
    longest tail of at most ``keep_last`` messages that begins with a user message; when
    the last ``keep_last`` hold none, the tail from the last user message. The rest (all
    of it, if nothing is cut) is summarized."""
    users = [i for i, m in enumerate(messages) if m.role is sa.Role.USER]
    if not users:
        return list(messages)  # (a turn always has its user message)
    cut = max(0, len(messages) - keep_last)
    start = next((i for i in users if i >= cut), users[-1])
    return list(messages[start:])
