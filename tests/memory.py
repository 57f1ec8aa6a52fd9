"""Measuring what a registry keeps: memory allocated while traced, besides what a store holds.

tracemalloc counts every Python allocation made while it traces and not freed since;
what the store keeps of the writes made meanwhile is subtracted (the objects reachable
from it that were allocated while traced), so what is left is what the registry, its
sessions and trio still hold.
"""

from __future__ import annotations

import gc
import sys
import tracemalloc
import types
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio
import trio.testing

_OPAQUE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)


def new_memory_held_by(root: object) -> int:
    """Bytes of the objects reachable from ``root`` allocated while tracemalloc traced."""
    seen = {id(root)}
    stack = [root]
    total = 0
    while stack:
        obj = stack.pop()
        if tracemalloc.get_object_traceback(obj) is not None:
            total += sys.getsizeof(obj)
        for ref in gc.get_referents(obj):
            if id(ref) not in seen and not isinstance(ref, _OPAQUE):
                seen.add(id(ref))
                stack.append(ref)
    return total


async def grow_trio_task_table(tasks: int) -> None:
    """Run ``tasks`` tasks at once, so that trio's own table of tasks (which never shrinks,
    and is rebuilt now and then as tasks come and go) is already larger than a test needs."""
    async with trio.open_nursery() as nursery:
        for _ in range(tasks):
            nursery.start_soon(trio.lowlevel.checkpoint)


class Held:
    """What ``traced_memory`` measured: ``bytes`` held when its block ended."""

    bytes: int = 0


@asynccontextmanager
async def traced_memory(store: object) -> AsyncIterator[Held]:
    """Trace allocations in the block; ``held.bytes`` is then what is still held, minus
    what ``store`` keeps of them. Tasks are let settle and garbage is collected first.

    Run it on the autojump clock: before measuring, it lets a virtual day pass so that
    trio forgets the deadlines of timeouts that are over (it drops them lazily).
    """
    held = Held()
    await trio.testing.wait_all_tasks_blocked()
    gc.collect()
    tracemalloc.start()
    try:
        yield held
        await trio.sleep(24 * 3600)
        await trio.testing.wait_all_tasks_blocked()
        gc.collect()
        held.bytes = tracemalloc.get_traced_memory()[0] - new_memory_held_by(store)
    finally:
        tracemalloc.stop()
