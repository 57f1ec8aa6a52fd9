"""10. Agents that act: a tool round trip vs a text turn; compaction at 10,000 messages.

Tool round trip: two sessions on one registry (MemoryStore, default durability),
sent turns alternately. One session's model answers at once with text; the
other's first answers with one call of an instant tool, then, seeing the
tool's result, with text. CPU time per turn; the median over rounds of the
per-round ratio. The target is at most 1.5x.

Compaction: a session with 10,000 messages (built through the library with
``durability="hibernate"``), then a registry whose agent has
``sa.Compaction(max_tokens=2000, keep_last=20)`` with an instant summarizer
sends one turn, which summarizes the 9,980 oldest messages away; the
baseline is the same turn to a twin session whose agent does not compact.
Wall time of that one turn, median over rounds.
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator

import trio

import sessionactors as sa
from _common import InstantModel, Row, cpu, log, median, now, paired, rounds, spread

TEXT = "Where is my order A1042? It was due yesterday."


class ToolThenText:
    """Calls the tool when the user just spoke; answers with text after the result."""

    async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        if request.messages[-1].role is sa.Role.USER:
            yield sa.ToolCallChunk(0, id="call-1", name="lookup", arguments="{}")
        else:
            yield sa.TextChunk("ok")


@sa.tool
async def lookup() -> str:
    """Look something up (instantly)."""
    return "found"


async def tool_round(turns: int) -> tuple[float, float]:
    agents = {
        "text": sa.Agent(model=InstantModel()),
        "tool": sa.Agent(model=ToolThenText(), tools=[lookup]),
    }
    async with sa.open_registry(agents=agents) as registry:
        text = await registry.spawn("text", agent="text")
        tool = await registry.spawn("tool", agent="tool")
        for _ in range(20):  # warm up
            await text.send(TEXT)
            await tool.send(TEXT)
        text_time = tool_time = 0.0
        for _ in range(turns):
            start = cpu()
            await text.send(TEXT)
            middle = cpu()
            await tool.send(TEXT)
            tool_time += cpu() - middle
            text_time += middle - start
        assert len(await tool.history()) == 4 * (turns + 20)
    return tool_time / turns, text_time / turns


async def compaction_round() -> tuple[float, float, int]:
    store = sa.MemoryStore()
    model = InstantModel()
    big = sa.Compaction(max_tokens=10**9, keep_last=20, summarizer=model)
    build = {"plain": sa.Agent(model=model), "compact": sa.Agent(model=model, compaction=big)}
    async with sa.open_registry(store=store, agents=build, durability="hibernate") as registry:
        for name in ("plain", "compact"):
            ref = await registry.spawn(name, agent=name)
            for _ in range(5000):
                await ref.send(TEXT)
            await ref.hibernate()
    small = sa.Compaction(max_tokens=2000, keep_last=20, summarizer=model)
    run = {"plain": sa.Agent(model=model), "compact": sa.Agent(model=model, compaction=small)}
    async with sa.open_registry(store=store, agents=run) as registry:
        plain, compact = registry.ref("plain"), registry.ref("compact")
        length = len(await compact.history())
        await plain.history()  # wake both before timing
        start = now()
        await compact.send(TEXT)
        middle = now()
        await plain.send(TEXT)
        end = now()
        assert len(await compact.history()) <= 22, len(await compact.history())
    return middle - start, end - middle, length


def main(args: argparse.Namespace) -> list[Row]:
    turns = 300 if args.quick else 2000
    count = rounds(args.quick, 7)
    tools: list[float] = []
    texts: list[float] = []
    for r in range(count):
        tool, text = trio.run(tool_round, turns)
        tools.append(tool)
        texts.append(text)
        log(f"  round {r + 1}/{count}: tool turn {tool * 1e6:.0f} us, text {text * 1e6:.0f} us")
    compacting: list[float] = []
    plains: list[float] = []
    length = 0
    for r in range(rounds(args.quick, 5, 2)):
        compact, plain, length = trio.run(compaction_round)
        compacting.append(compact)
        plains.append(plain)
        log(f"  round {r + 1}: compacting turn {compact * 1e3:.1f} ms, plain {plain * 1e3:.2f} ms")
    group = "10 agents that act"
    return [
        Row(
            benchmark=group,
            name="a turn with one tool round trip (instant model and tool)",
            measured=median(tools) * 1e6,
            unit="us",
            baseline=median(texts) * 1e6,
            baseline_name="a plain text turn, same registry",
            baseline_unit="us",
            target_on="ratio",
            target_op="<=",
            target_value=1.5,
            paired_ratio=paired(tools, texts),
            notes=f"CPU time, {turns} turns each, alternating; {spread(tools)}",
        ),
        Row(
            benchmark=group,
            name=f"a turn that compacts {length:,} messages (instant summarizer)",
            measured=median(compacting) * 1e3,
            unit="ms",
            baseline=median(plains) * 1e3,
            baseline_name=f"the same turn at {length:,} messages without compaction",
            baseline_unit="ms",
            paired_ratio=paired(compacting, plains),
            notes=f"wall time of one turn; 22 messages are left after it; {spread(compacting)}",
        ),
    ]


if __name__ == "__main__":
    from _common import run_main

    run_main(main, __doc__ or "")
