"""``python -m sessionactors serve`` in a subprocess, for the tests that need a whole server."""

import os
import re
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import attrs

HERE = Path(__file__).resolve().parent


@attrs.frozen
class Server:
    url: str
    process: subprocess.Popen[str]
    line: str = ""  # what it printed as it began to serve

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])


@contextmanager
def serve_command(store: str, *extra: str, stop: int = signal.SIGTERM) -> Iterator[Server]:
    """Run ``serve --store STORE --agent chat_agents:agents --port 0 EXTRA...`` from this
    directory; on exit send ``stop`` and check that it shut down cleanly (status 0)."""
    command = [sys.executable, "-m", "sessionactors", "serve", "--store", store]
    command += ["--agent", "chat_agents:agents", "--port", "0", *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        command, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        assert process.stdout is not None
        line = _readline(process.stdout, deadline=time.monotonic() + 30)
        match = re.search(r"http://127\.0\.0\.1:\d+", line)
        assert match, f"serve printed {line!r}"
        yield Server(match.group(0), process, line)
        process.send_signal(stop)
        _, stderr = process.communicate(timeout=30)
        assert process.returncode == 0, stderr
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
