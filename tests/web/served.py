"""``python -m sessionactors serve`` in a subprocess, for the tests that need a whole server."""

import os
import re
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import attrs

HERE = Path(__file__).resolve().parent

#: A line of serve's log on stderr: its time, its level, its logger.
LOG_LINE = re.compile(
    r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) \S+: "
)


@attrs.frozen
class Server:
    url: str
    process: subprocess.Popen[str]
    line: str = ""  # what it printed as it began to serve
    #: what it wrote on stderr, once it has exited (filled in by ``serve_command``)
    said: list[str] = attrs.field(factory=list)

    @property
    def stderr(self) -> str:
        return "".join(self.said)

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])


def _default_signals() -> None:
    """In the child, before it runs serve: the stop signals as a shell in a terminal
    leaves them, whatever this test run inherited (a background job, nohup or CI may
    have them ignored, which the child would inherit and serve would then leave so)."""
    for number in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM):
        signal.signal(number, signal.SIG_DFL)


@contextmanager
def serve_command(
    store: str | None,
    *extra: str,
    stop: int = signal.SIGTERM,
    status: int = 0,
    env: Mapping[str, str] | None = None,
    launcher: Sequence[str] = (),
) -> Iterator[Server]:
    """Run ``serve --store STORE --agent chat_agents:agents --port 0 EXTRA...`` from this
    directory (without ``--store`` if ``store`` is None; with ``env`` added to the
    environment, and under ``launcher``, a command such as ``nohup``, if given); on exit
    send ``stop`` and check that it exited with ``status`` (0: it shut down cleanly). What
    it wrote on stderr is then in ``server.stderr``."""
    command = [*launcher, sys.executable, "-m", "sessionactors", "serve"]
    command += [] if store is None else ["--store", store]
    command += ["--agent", "chat_agents:agents", "--port", "0", *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    process = subprocess.Popen(
        command,
        cwd=HERE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=_default_signals,
    )
    try:
        assert process.stdout is not None
        line = _readline(process.stdout, deadline=time.monotonic() + 30)
        match = re.search(r"http://127\.0\.0\.1:\d+", line)
        assert match, f"serve printed {line!r}"
        server = Server(match.group(0), process, line)
        yield server
        process.send_signal(stop)
        _, stderr = process.communicate(timeout=30)
        server.said.append(stderr)
        assert process.returncode == status, stderr
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
        for stream in (process.stdout, process.stderr):
            if stream is not None:
                stream.close()


def _readline(stream: object, deadline: float) -> str:
    with selectors.DefaultSelector() as selector:
        selector.register(stream, selectors.EVENT_READ)  # type: ignore[arg-type]
        while time.monotonic() < deadline:
            if selector.select(timeout=0.1):
                return stream.readline()  # type: ignore[attr-defined, no-any-return]
    raise TimeoutError("serve printed nothing within 30 s")
