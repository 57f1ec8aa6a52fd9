"""Shared helpers for the benchmark scripts: rows, timing, memory, child processes.

Every ``bench_*.py`` script is run by ``run.py`` in a fresh interpreter as
``python benchmarks/bench_NAME.py --out FILE [--quick]`` and writes its rows
to ``FILE`` as JSON. Memory benchmarks start one more fresh interpreter per
measurement (``child``), so that one measurement never inherits the heap of
another.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import gc
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import sessionactors as sa

HERE = Path(__file__).resolve().parent
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


# ---- rows -----------------------------------------------------------------------------


@dataclass
class Row:
    """One line of the results table.

    ``ratio`` is ``measured / baseline``: the median over the rounds of the
    ratio within each round (``paired_ratio``) when both were measured in every
    round, which cancels the machine's drift between rounds. A target applies either to the
    ratio (``target_on="ratio"``) or to the measured value itself
    (``target_on="measured"``); ``target_op`` is ``"<="`` or ``">="``.
    """

    benchmark: str
    name: str
    measured: float
    unit: str
    baseline: float | None = None
    baseline_name: str = ""
    baseline_unit: str = ""
    target_on: str = ""
    target_op: str = ""
    target_value: float | None = None
    notes: str = ""
    paired_ratio: float | None = None

    @property
    def ratio(self) -> float | None:
        if self.paired_ratio is not None:
            return self.paired_ratio
        if self.baseline is None or self.baseline == 0:
            return None
        return self.measured / self.baseline

    @property
    def met(self) -> bool | None:
        if self.target_value is None:
            return None
        value = self.ratio if self.target_on == "ratio" else self.measured
        if value is None:
            return None
        if self.target_op == "<=":
            return value <= self.target_value
        return value >= self.target_value

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["ratio"] = self.ratio
        data["met"] = self.met
        return data


def write_rows(path: str, rows: list[Row], extra: dict[str, Any] | None = None) -> None:
    payload = {"rows": [r.to_json() for r in rows], "extra": extra or {}}
    Path(path).write_text(json.dumps(payload, indent=2))


def parse_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", help="write the rows here as JSON")
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer rounds")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # one isolated measurement
    parser.add_argument("--n", type=int, default=0, help=argparse.SUPPRESS)
    return parser.parse_args()


def log(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


# ---- timing ---------------------------------------------------------------------------

#: Wall clock: for benchmarks that wait on I/O (SQLite commits, Redis).
now = time.perf_counter
#: This process's CPU time: for CPU-bound benchmarks, so that other load on a
#: shared machine (which stretches wall time) does not count.
cpu = time.process_time


def median(values: list[float]) -> float:
    return statistics.median(values)


def paired(measured: list[float], baseline: list[float]) -> float:
    """The median of the per-round ratios ``measured[i] / baseline[i]``."""
    return statistics.median(m / b for m, b in zip(measured, baseline, strict=True))


@dataclass
class Collections:
    """What the garbage collector did in a block: its seconds, and its full collections."""

    seconds: float = 0.0
    full: int = 0


@contextlib.contextmanager
def collector_time() -> Iterator[Collections]:
    """Time the garbage collector's runs in the block (any thread's), for the notes."""
    got = Collections()
    started = 0.0

    def callback(phase: str, info: dict[str, int]) -> None:
        nonlocal started
        if phase == "start":
            started = time.perf_counter()
            return
        got.seconds += time.perf_counter() - started
        got.full += info["generation"] == 2

    gc.callbacks.append(callback)
    try:
        yield got
    finally:
        gc.callbacks.remove(callback)


def spread(values: list[float]) -> str:
    """``min..max`` of the rounds, relative to the median, for the notes."""
    m = statistics.median(values)
    if not m:
        return ""
    return f"rounds {min(values) / m:.2f}..{max(values) / m:.2f} of median"


# ---- memory ---------------------------------------------------------------------------

_libc: Any = None
with contextlib.suppress(OSError, TypeError):
    _libc = ctypes.CDLL(ctypes.util.find_library("c"))


def rss_bytes() -> int:
    """The resident set size of this process (``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE_SIZE


def settled_rss() -> int:
    """RSS after a full collection and handing free heap pages back to the system."""
    gc.collect()
    gc.collect()
    if _libc is not None and hasattr(_libc, "malloc_trim"):
        _libc.malloc_trim(0)
    return rss_bytes()


def child(script: Path, variant: str, *, n: int, timeout: float = 600) -> dict[str, Any]:
    """Run one isolated measurement in a fresh interpreter; its last stdout line is JSON."""
    proc = subprocess.run(
        [sys.executable, str(script), "--child", variant, "--n", str(n)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"{script.name} --child {variant} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def child_exit(result: dict[str, Any]) -> None:
    """Report a child's result and leave at once (no slow teardown of 100,000 tasks)."""
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---- models ---------------------------------------------------------------------------


class InstantModel:
    """Answers at once with one chunk: no checkpoint, no work, to expose the overhead."""

    async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        yield sa.TextChunk("ok")


class ChunkModel:
    """Answers with ``chunks`` text chunks, back to back (no checkpoint between them)."""

    def __init__(self, chunks: int) -> None:
        self._chunks = [sa.TextChunk(f"w{i} ") for i in range(chunks)]

    async def stream(self, request: sa.ModelRequest) -> AsyncIterator[sa.ModelChunk]:
        for chunk in self._chunks:
            yield chunk


def agents(model: sa.Model) -> dict[str, sa.Agent]:
    return {"bench": sa.Agent(model=model)}


# ---- temporary files and a private redis-server -------------------------------------


@contextlib.contextmanager
def temp_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="sessionactors-bench-") as tmp:
        yield Path(tmp)


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
def redis_url() -> Iterator[str | None]:
    """``SESSIONACTORS_REDIS_URL`` (the first, where it holds several separated by spaces,
    as CI sets it), else a private durable redis-server on 127.0.0.1, else None."""
    url = next(iter(os.environ.get("SESSIONACTORS_REDIS_URL", "").split()), None)
    if url:
        yield url
        return
    binary = shutil.which("redis-server")
    if binary is None:
        yield None
        return
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="sessionactors-bench-redis-") as tmp:
        # durable, as RedisStore demands: an append-only file fsync'd on every write
        process = subprocess.Popen(
            [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--dir", tmp,
             "--appendonly", "yes", "--appendfsync", "always"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 10
            while not _ping(port):
                if process.poll() is not None or time.monotonic() > deadline:
                    yield None
                    return
                time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            process.terminate()
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def rounds(quick: bool, full: int, small: int = 3) -> int:
    return small if quick else full


def run_main(main: Callable[[argparse.Namespace], list[Row]], description: str) -> None:
    args = parse_args(description)
    rows = main(args)
    for row in rows:
        ratio = f"{row.ratio:.2f}x" if row.ratio is not None else "-"
        log(f"  {row.name}: {row.measured:.4g} {row.unit} (baseline {row.baseline}) {ratio}")
    if args.out:
        write_rows(args.out, rows)
