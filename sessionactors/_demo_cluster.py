"""``sessionactors demo-cluster``: three worker processes on one redis-server.

The demo starts a private ``redis-server`` on a free loopback port, three worker
processes (each a registry on a ``RedisStore``), and plays a load balancer:
every request goes to the next worker in turn, whichever worker runs the
conversation. It then kills one worker with SIGKILL and shows every
conversation carrying on, with every acknowledged message still there.

The worker processes run ``python -m sessionactors._demo_cluster worker ...``
and take one JSON command per stdin line (the benchmarks drive them too).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

import trio

__all__ = ["RedisMissingError", "WorkerProcess", "demo_cluster", "redis_server", "worker_main"]

INSTALL_HINT = (
    "redis-server is not installed; on Debian or Ubuntu: sudo apt-get install redis-server "
    "(the demo starts its own server on 127.0.0.1 and stops it at the end)"
)


def _say(text: str = "") -> None:
    print(text, flush=True)


# ---- a private redis-server ----------------------------------------------------------


class RedisMissingError(RuntimeError):
    """No redis-server binary was found."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"*1\r\n$4\r\nPING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    """Run a throwaway durable redis-server (append-only file, fsync on every write) on a
    free loopback port; yield its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RedisMissingError(INSTALL_HINT)
    with tempfile.TemporaryDirectory(prefix="sessionactors-redis-") as tmp:
        port = _free_port()
        process = subprocess.Popen(
            # durable, as RedisStore demands: every acknowledged write is on disk
            [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "",
             "--appendonly", "yes", "--appendfsync", "always", "--daemonize", "no",
             "--dir", tmp],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 10
            while not _ping(port):
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{binary} did not start on port {port}")
                time.sleep(0.02)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            process.terminate()
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


# ---- the worker process --------------------------------------------------------------


def _emit(line: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()


async def _commands() -> AsyncIterator[dict[str, Any]]:
    stream = trio.lowlevel.FdStream(os.dup(0))
    buffer = b""
    while True:
        data = await stream.receive_some(65536)
        if not data:
            return
        buffer += data
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            if line.strip():
                yield json.loads(line)


async def _worker(url: str, prefix: str, worker_id: str, ttl: float, balance: bool) -> None:
    from ._agent import Agent
    from ._registry import Registry, open_registry
    from .stores._redis import RedisStore
    from .testing._models import EchoModel

    agents = {"echo": Agent(model=EchoModel())}
    store = RedisStore(url, prefix=prefix, balance=balance)

    async def run(registry: Registry, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        if op == "spawn":  # spawned and woken: this worker runs them
            for name in cmd["names"]:
                await (await registry.get_or_spawn(name)).state()
            return {"ok": True}
        if op == "send":
            reply = await registry.ref(cmd["name"]).send(
                cmd["text"], idempotency_key=cmd.get("key")
            )
            return {"text": reply.text, "turn_id": reply.turn_id}
        if op == "live":
            return {"live": registry.live()}
        if op == "history":
            history = await registry.ref(cmd["name"]).history()
            return {"messages": [[m.role.value, m.content] for m in history]}
        if op == "converse":  # every named session, ``turns`` turns each, all at once
            start = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for name in cmd["names"]:

                    async def talk(name: str = name) -> None:
                        ref = registry.ref(name)
                        for i in range(cmd["turns"]):
                            await ref.send(f"turn {i} of {name}")

                    nursery.start_soon(talk)
            return {"seconds": time.perf_counter() - start}
        raise ValueError(f"unknown command {op!r}")

    async def answer(registry: Registry, cmd: dict[str, Any]) -> None:
        try:
            result = await run(registry, cmd)
        except Exception as exc:
            result = {"error": type(exc).__name__, "message": str(exc)}
        _emit({"id": cmd.get("id"), **result})

    async with open_registry(
        store=store, agents=agents, lease_ttl=ttl, worker_id=worker_id, shutdown_grace=2.0
    ) as registry:
        _emit({"ready": worker_id})
        async with trio.open_nursery() as nursery:
            async for cmd in _commands():
                if cmd["op"] == "quit":
                    break
                nursery.start_soon(answer, registry, cmd)
            nursery.cancel_scope.cancel()


def worker_main(argv: Sequence[str]) -> None:
    """``worker URL PREFIX WORKER_ID LEASE_TTL [fixed]``: serve JSON commands on stdin
    (``fixed``: ``RedisStore(balance=False)``)."""
    url, prefix, worker_id, ttl, *rest = argv
    with contextlib.suppress(KeyboardInterrupt):
        trio.run(_worker, url, prefix, worker_id, float(ttl), rest != ["fixed"])


class WorkerProcess:
    """A worker started as a subprocess of this one, answering JSON commands."""

    def __init__(self, process: trio.Process, name: str) -> None:
        self.process = process
        self.name = name
        self._answers: dict[int, dict[str, Any]] = {}
        self._arrived = trio.Event()
        self._ids = itertools.count()
        self._writing = trio.StrictFIFOLock()
        self.ended = False

    @classmethod
    async def start(
        cls,
        nursery: trio.Nursery,
        url: str,
        prefix: str,
        name: str,
        ttl: float,
        *,
        balance: bool = True,
    ) -> WorkerProcess:
        command = [sys.executable, "-m", "sessionactors._demo_cluster", "worker"]
        command += [url, prefix, name, str(ttl)] + ([] if balance else ["fixed"])
        process = await trio.lowlevel.open_process(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        worker = cls(process, name)
        await nursery.start(worker._read)
        return worker

    async def _read(self, task_status: trio.TaskStatus[None]) -> None:
        assert self.process.stdout is not None
        buffer = b""
        started = False
        try:
            while True:
                data = await self.process.stdout.receive_some(65536)
                if not data:
                    break
                buffer += data
                while b"\n" in buffer:
                    raw, buffer = buffer.split(b"\n", 1)
                    line = json.loads(raw)
                    if "ready" in line and not started:
                        started = True
                        task_status.started()
                    elif "id" in line:
                        self._answers[line["id"]] = line
                        self._arrived.set()
                        self._arrived = trio.Event()
        finally:
            self.ended = True
            self._arrived.set()
        if not started:
            raise RuntimeError(f"worker {self.name} exited before it was ready")

    async def call(self, op: str, **args: Any) -> dict[str, Any]:
        """Send a command; its answer (``{"error": ...}`` if it raised)."""
        rid = next(self._ids)
        assert self.process.stdin is not None
        line = json.dumps({"id": rid, "op": op, **args}).encode() + b"\n"
        async with self._writing:
            await self.process.stdin.send_all(line)
        while rid not in self._answers:
            if self.ended:
                raise RuntimeError(f"worker {self.name} ended before answering {op!r}")
            await self._arrived.wait()
        return self._answers.pop(rid)

    def kill(self) -> None:
        if self.process.returncode is None:
            os.kill(self.process.pid, signal.SIGKILL)

    async def quit(self) -> None:
        if self.process.returncode is None and self.process.stdin is not None:
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await self.process.stdin.send_all(b'{"op": "quit"}\n')
        with trio.move_on_after(10):
            await self.process.wait()
        self.kill()


# ---- the demo --------------------------------------------------------------------------

TTL = 2.0
CONVERSATIONS = 12
TURNS = 3  # messages per conversation before the kill
MORE = 8  # messages per conversation during and after it


async def _demo(url: str) -> bool:
    names = [f"conv-{i:02d}" for i in range(CONVERSATIONS)]
    prefix = "sessionactors-demo-cluster"
    async with trio.open_nursery() as nursery:
        workers: list[WorkerProcess] = []
        try:
            for i in range(3):
                workers.append(await WorkerProcess.start(nursery, url, prefix, f"worker-{i}", TTL))
            _say(f"three workers up ({', '.join(w.name for w in workers)}), lease_ttl={TTL} s")
            ok = await _play(workers, names)
        finally:
            for worker in workers:
                await worker.quit()
            nursery.cancel_scope.cancel()
    return ok


async def _owners(workers: Sequence[WorkerProcess]) -> dict[str, str]:
    owners: dict[str, str] = {}
    for worker in workers:
        for name in (await worker.call("live"))["live"]:
            owners[name] = worker.name
    return owners


class _Balancer:
    """Round-robin over the workers still alive, as a load balancer would."""

    def __init__(self, workers: Sequence[WorkerProcess]) -> None:
        self.workers = list(workers)
        self._turn = itertools.count()

    def next(self) -> WorkerProcess:
        alive = [w for w in self.workers if not w.ended]
        return alive[next(self._turn) % len(alive)]


async def _conversations(
    balancer: _Balancer,
    names: Sequence[str],
    turns: range,
    acked: dict[str, int],
    on_ack: Callable[[], None] = lambda: None,
) -> float:
    """Each conversation sends ``turns`` messages, each through the next worker.

    A request whose worker dies is sent again through another one, with the same
    idempotency key. Returns the longest wait for one acknowledgement."""
    slowest = 0.0

    async def talk(name: str) -> None:
        nonlocal slowest
        for t in turns:
            text = f"message {t} of {name}"
            start = time.perf_counter()
            for _attempt in range(10):
                worker = balancer.next()
                try:
                    answer = await worker.call("send", name=name, text=text, key=f"{name}/{t}")
                except RuntimeError:  # the worker died with the request: try another
                    continue
                if "error" not in answer:
                    break
                _say(f"   {name}: {worker.name} answered {answer['error']}; retrying elsewhere")
            else:
                raise RuntimeError(f"{name}: message {t} was never acknowledged")
            slowest = max(slowest, time.perf_counter() - start)
            if answer["text"] != text:
                raise RuntimeError(f"{name} got someone else's reply: {answer['text']!r}")
            acked[name] += 1
            on_ack()

    async with trio.open_nursery() as nursery:
        for name in names:
            nursery.start_soon(talk, name)
    return slowest


async def _play(workers: list[WorkerProcess], names: list[str]) -> bool:
    for i, name in enumerate(names):
        await workers[i % 3].call("spawn", names=[name])
    acked = dict.fromkeys(names, 0)
    balancer = _Balancer(workers)
    _say(f"\n-- {CONVERSATIONS} conversations, {TURNS} messages each, round-robin over 3 workers")
    await _conversations(balancer, names, range(TURNS), acked)
    owners = await _owners(workers)
    for worker in workers:
        mine = sorted(n for n, o in owners.items() if o == worker.name)
        _say(f"   {worker.name} runs {len(mine)}: {', '.join(mine)}")
    before = dict(acked)

    victim = workers[2]
    lost_owner = sorted(n for n, o in owners.items() if o == victim.name)
    _say(
        f"\n-- {MORE} more messages each through all three; after {CONVERSATIONS} of them, "
        f"kill -9 {victim.name} (it runs {', '.join(lost_owner) or 'nothing'})"
    )
    slowest = 0.0
    enough = trio.Event()

    def on_ack() -> None:
        if sum(acked.values()) - sum(before.values()) >= CONVERSATIONS:
            enough.set()

    async with trio.open_nursery() as nursery:

        async def more() -> None:
            nonlocal slowest
            turns = range(TURNS, TURNS + MORE)
            slowest = await _conversations(balancer, names, turns, acked, on_ack)

        nursery.start_soon(more)
        await enough.wait()
        victim.kill()
        _say(f"   killed it after {sum(acked.values()) - sum(before.values())} more acks")
    _say(
        f"   the slowest request waited {slowest:.2f} s (a takeover waits for the dead "
        f"worker's lease to lapse: at most lease_ttl={TTL} s)"
    )
    survivors = workers[:2]
    owners_after = await _owners(survivors)

    _say("\n   conversation  owner before -> after   acked before  acked after  stored")
    intact = 0
    for name in names:
        history = (await survivors[0].call("history", name=name))["messages"]
        users = [content for role, content in history if role == "user"]
        expected = [f"message {t} of {name}" for t in range(acked[name])]
        good = users == expected
        intact += good
        mark = "ok" if good else "MISMATCH"
        _say(
            f"   {name}       {owners.get(name, '-'):>8} -> {owners_after.get(name, '-'):<8}"
            f"   {before[name]:>6}        {acked[name]:>6}      {len(users):>4}  {mark}"
        )
    _say(
        f"\n{intact}/{len(names)} conversations carried on with every acknowledged message, "
        "in order, none twice"
    )
    return intact == len(names)


def demo_cluster() -> int:
    """Run the demo; the process exit status (0: every conversation intact)."""
    _say("== sessionactors demo-cluster: three workers, one redis-server, one killed")
    try:
        with redis_server() as url:
            _say(f"redis-server started at {url} (appendonly yes, appendfsync always)")
            ok = trio.run(_demo, url)
    except RedisMissingError as exc:
        _say(str(exc))
        return 1
    _say("stopped the workers and redis-server")
    return 0 if ok else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        worker_main(sys.argv[2:])
    else:
        sys.exit(demo_cluster())
