"""SSE over HTTP: the cost per event per SSE client, and 1,000 concurrent SSE clients.

Cost per event per SSE client: the gateway (``sessionactors.http.create_app``)
under hypercorn's trio worker in this process; S = 10 SSE clients in another
process hold ``GET /sessions/bench/events`` open and read every event; a
turn whose model streams 200 chunks back to back. This process's CPU time
per turn (until every client has the turn's ``TurnFinished``), minus the
same turns with no client, divided by S and by the events of the turn. The
baseline is ``bench_fanout``'s measure: S in-process subscribers (trio tasks
reading ``ref.subscribe()``) in place of the SSE clients. The ratio says what
an event costs the server to put on the wire (JSON, SSE framing, HTTP
chunking, a socket write) against handing it to a task.

1,000 concurrent SSE clients: 1,000 sessions, one SSE client each, held by
two client processes (500 connections each). Turns start on the sessions
one after another, 200 turns a second; each turn streams 10 deltas 10 ms
apart, about 2,000 deltas a second in all. Each delta carries the moment
the model yielded it (``CLOCK_MONOTONIC``, shared by the processes); the
client notes when its bytes arrive. p50 and p99 of the difference, over
every delta. The client processes' own scheduling is part of the figure.

Results: printed, and with ``--out FILE`` written as rows; by default also
``benchmarks/results/sse.json`` and ``sse.md``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import hypercorn.config
import hypercorn.trio
import trio

import sessionactors as sa
from _common import HERE, ChunkModel, Row, agents, cpu, log, median, paired, spread, write_rows
from sessionactors.http import create_app

CHUNKS = 200
CLIENTS = 10
VIEWERS = 1000
DELTAS = 10
PACE = 0.010  # seconds between a turn's deltas
TURNS_PER_SECOND = 200


def _raise_file_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


@functools.cache
def _config() -> hypercorn.config.Config:
    config = hypercorn.config.Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.errorlog = None
    config.backlog = 2048
    config.graceful_timeout = 1
    return config


class _Server:
    """The gateway under hypercorn's trio worker, in this trio run."""

    def __init__(self, registry: sa.Registry) -> None:
        self.app = create_app(registry, heartbeat=60)
        self.stop = trio.Event()
        self.url = ""

    async def run(self, task_status: trio.TaskStatus[None]) -> None:
        serve = functools.partial(
            hypercorn.trio.serve, self.app, _config(), shutdown_trigger=self.stop.wait
        )
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(serve)
            self.url = binds[0]
            task_status.started()


class _Clients:
    """A client process: its stdout lines, read one at a time."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        assert process.stdout is not None
        self._stdout = process.stdout
        self._buffer = b""

    async def line(self) -> str:
        while b"\n" not in self._buffer:
            data = await self._stdout.receive_some(65536)
            if not data:
                raise RuntimeError("the client process ended early")
            self._buffer += data
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode()


async def _start_clients(mode: str, url: str, paths: list[str], count: int) -> _Clients:
    command = [sys.executable, str(HERE / "bench_sse.py"), "client", mode, url, str(count)]
    process = await trio.lowlevel.open_process(
        [*command, *paths], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    clients = _Clients(process)
    ready = await clients.line()
    assert ready == "ready", ready
    return clients


# ---- cost per event per client -------------------------------------------------------------


async def _turns(registry: sa.Registry, turns: int, wait: Any) -> float:
    ref = registry.ref("bench")
    for _ in range(2):  # warm up
        await ref.send("go")
        await wait()
    start = cpu()
    for _ in range(turns):
        await ref.send("go")
        await wait()
    return (cpu() - start) / turns


async def cost_round(turns: int) -> tuple[float, float, float, float]:
    """CPU per turn: (no reader, S SSE clients, S in-process subscribers), events per turn."""
    async with sa.open_registry(
        agents=agents(ChunkModel(CHUNKS)), store=sa.MemoryStore()
    ) as registry:
        await registry.spawn("bench")
        server = _Server(registry)
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run)

            async def nothing() -> None:
                await trio.lowlevel.checkpoint()

            bare = await _turns(registry, turns, nothing)

            clients = await _start_clients(
                "count", server.url, ["/sessions/bench/events"] * CLIENTS, CLIENTS
            )

            async def all_clients_done() -> None:
                line = await clients.line()
                assert line.startswith("turn"), line

            sse = await _turns(registry, turns, all_clients_done)
            assert clients.process.stdin is not None
            await clients.process.stdin.aclose()
            events = float((await clients.line()).split()[1])
            await clients.process.wait()

            done = trio.Semaphore(0)

            async def reader(task_status: trio.TaskStatus[None]) -> None:
                async with registry.ref("bench").subscribe() as stream:
                    task_status.started()
                    async for event in stream:
                        if isinstance(event, sa.TurnFinished):
                            done.release()

            async with trio.open_nursery() as readers:
                for _ in range(CLIENTS):
                    await readers.start(reader)

                async def all_readers_done() -> None:
                    for _ in range(CLIENTS):
                        await done.acquire()

                local = await _turns(registry, turns, all_readers_done)
                readers.cancel_scope.cancel()
            server.app.drain()
            server.stop.set()
    return bare, sse, local, events


# ---- 1,000 concurrent clients --------------------------------------------------------------


class StampModel:
    """Streams ``DELTAS`` chunks, ``PACE`` seconds apart, each the time it was yielded."""

    async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        for _ in range(DELTAS):
            await trio.sleep(PACE)
            yield sa.TextChunk(str(time.monotonic_ns()))


async def many_clients(viewers: int) -> tuple[list[float], float, float, float]:
    """Delays in ms of every delta at its SSE client; the deltas per second; the wall time;
    the server's CPU time over that wall time (1.0: one core busy all along)."""
    async with sa.open_registry(agents=agents(StampModel()), store=sa.MemoryStore()) as registry:
        names = [f"viewer-{i:04d}" for i in range(viewers)]
        for name in names:
            await registry.spawn(name)
        server = _Server(registry)
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run)
            half = viewers // 2
            groups = [names[:half], names[half:]]
            clients = []
            for group in groups:
                paths = [f"/sessions/{name}/events" for name in group]
                clients.append(await _start_clients("stamps", server.url, paths, DELTAS))
            assert registry.statistics().subscribers == viewers
            start, start_cpu = time.perf_counter(), cpu()
            begin = trio.current_time()
            async with trio.open_nursery() as turns:
                for i, name in enumerate(names):
                    await trio.sleep_until(begin + i / TURNS_PER_SECOND)
                    turns.start_soon(registry.ref(name).send, "go")
            wall = time.perf_counter() - start
            busy = (cpu() - start_cpu) / wall
            delays: list[float] = []
            for client in clients:
                delays += json.loads(await client.line())
                await client.process.wait()
            server.app.drain()
            server.stop.set()
    return delays, viewers * DELTAS / wall, wall, busy


# ---- the client processes ------------------------------------------------------------------

_FRAME_END = b"\n\n"
_STAMP = re.compile(rb'"type":"Delta".*?"text":"(\d+)"')


async def _client(mode: str, url: str, count: int, paths: list[str]) -> None:
    """``count`` mode: print "turn N" each time every connection has seen N TurnFinished,
    and "events E" (per connection per turn) when stdin closes. ``stamps`` mode: read
    ``count`` deltas per connection and print their delays (ms) as JSON."""
    _raise_file_limit()
    host, port = url.removeprefix("http://").rsplit(":", 1)
    ready = trio.Semaphore(0)
    finished = [0] * len(paths)
    events = [0] * len(paths)
    delays: list[float] = []
    printed = 0

    def say(text: str) -> None:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()

    async def connection(index: int, path: str) -> None:
        nonlocal printed
        stream = await trio.open_tcp_stream(host, int(port))
        request = f"GET {path} HTTP/1.1\r\nHost: {host}\r\nAccept: text/event-stream\r\n\r\n"
        await stream.send_all(request.encode())
        buffer = b""
        while b"\r\n\r\n" not in buffer:
            buffer += await stream.receive_some(65536)
        buffer = buffer.partition(b"\r\n\r\n")[2]
        ready.release()
        seen = 0
        while True:
            data = await stream.receive_some(65536)
            arrived = time.monotonic_ns()
            if not data:
                return
            buffer += data
            *frames, buffer = buffer.split(_FRAME_END)
            for frame in frames:
                if b'"seq"' not in frame:
                    continue
                events[index] += 1
                if mode == "stamps":
                    match = _STAMP.search(frame)
                    if match:
                        delays.append((arrived - int(match.group(1))) / 1e6)
                        seen += 1
                        if seen == count:
                            await stream.aclose()
                            return
                elif b'"type":"TurnFinished"' in frame:
                    finished[index] += 1
                    if min(finished) > printed:
                        printed += 1
                        say(f"turn {printed}")

    async with trio.open_nursery() as nursery:
        for index, path in enumerate(paths):
            nursery.start_soon(connection, index, path)
        for _ in paths:
            await ready.acquire()
        say("ready")
        if mode == "count":
            stdin = trio.lowlevel.FdStream(0)
            while await stdin.receive_some(1024):
                pass
            say(f"events {sum(events) / len(paths) / max(printed, 1):.1f}")
            nursery.cancel_scope.cancel()
    if mode == "stamps":
        say(json.dumps(delays))


# ---- main ------------------------------------------------------------------------------------


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def run(quick: bool) -> list[Row]:
    _raise_file_limit()
    rounds = 3 if quick else 5
    turns = 8 if quick else 15
    sse: list[float] = []
    local: list[float] = []
    events = 0.0
    for _ in range(rounds):
        bare, with_sse, with_local, events = await cost_round(turns)
        sse.append((with_sse - bare) / (CLIENTS * events))
        local.append((with_local - bare) / (CLIENTS * events))
    sse_us, local_us = median(sse) * 1e6, median(local) * 1e6
    log(f"  per event per client: SSE {sse_us:.1f} us, in-process {local_us:.2f} us")
    rows = [
        Row(
            benchmark="14 SSE",
            name=f"per event per SSE client, {CLIENTS} clients",
            measured=median(sse) * 1e6,
            unit="us",
            baseline=median(local) * 1e6,
            baseline_name=f"per event per in-process subscriber, {CLIENTS} subscribers",
            baseline_unit="us",
            paired_ratio=paired(sse, local),
            notes=(
                f"hypercorn trio worker; {events:.0f} events per turn ({CHUNKS} deltas); "
                f"server CPU time; {spread(sse)}"
            ),
        )
    ]
    for viewers in (50, 200) if quick else (100, VIEWERS):
        load = os.getloadavg()[0]
        delays, rate, wall, busy = await many_clients(viewers)
        p50, p99 = _percentile(delays, 0.50), _percentile(delays, 0.99)
        log(
            f"  {viewers} clients: p50 {p50:.2f} ms, p99 {p99:.2f} ms, {rate:.0f} deltas/s, "
            f"server CPU {busy:.0%} of a core"
        )
        for name, value in (("p50", p50), ("p99", p99)):
            rows.append(
                Row(
                    benchmark="14 SSE",
                    name=f"{viewers} concurrent SSE clients: delta publication to arrival, {name}",
                    measured=value,
                    unit="ms",
                    notes=(
                        f"{len(delays)} deltas over {wall:.1f} s ({rate:.0f} deltas/s, offered "
                        f"{TURNS_PER_SECOND * DELTAS}), one session per client, 2 client "
                        f"processes; server CPU {busy:.0%} of a core; max {max(delays):.1f} ms; "
                        f"mean {statistics.fmean(delays):.2f} ms; load average {load:.1f} on "
                        f"{os.cpu_count()} cores"
                    ),
                )
            )
    return rows


def _markdown(rows: list[Row]) -> str:
    lines = [
        "# SSE benchmark (benchmarks/bench_sse.py)",
        "",
        f"Run {time.strftime('%Y-%m-%d %H:%M')} on a shared machine; see the script's docstring.",
        "",
        "| benchmark | measured | baseline | ratio | notes |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        baseline = (
            f"{row.baseline:.2f} {row.baseline_unit} ({row.baseline_name})" if row.baseline else ""
        )
        ratio = f"{row.ratio:.1f}x" if row.ratio is not None else ""
        lines.append(
            f"| {row.name} | {row.measured:.2f} {row.unit} | {baseline} | {ratio} | {row.notes} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "client":
        mode, url, count, *paths = sys.argv[2:]
        trio.run(_client, mode, url, int(count), paths)
        return
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", help="write the rows here as JSON (run.py's form)")
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer rounds")
    args = parser.parse_args()
    started = time.perf_counter()
    rows = trio.run(run, args.quick)
    log(f"  took {time.perf_counter() - started:.0f} s")
    if args.out:
        write_rows(args.out, rows)
    else:
        results = HERE / "results"
        write_rows(str(results / "sse.json"), rows)
        (results / "sse.md").write_text(_markdown(rows))


if __name__ == "__main__":
    main()
