"""``python -m sessionactors serve`` as an operator runs it: its log on stderr, its
signals and exit statuses, its token kept off the command line, and its health route."""

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import httpx
import pytest
import sniffio
import trio
import trio.testing

import sessionactors as sa
from sessionactors.testing import FaultyStore

from .served import HERE, serve_command
from .servers import Serve


def test_serve_logs_a_store_failure_naming_the_session(tmp_path: Path) -> None:
    """A store that fails while serving (its SQLite file deleted under it) is written to
    stderr, with a time, a level and the session's name, where a client is told only that
    "the server's log has the details"."""
    path = tmp_path / "served.db"
    with (
        serve_command(f"sqlite:///{path}") as server,
        httpx.Client(base_url=server.url, timeout=30) as client,
    ):
        assert client.post("/sessions/c3/messages", json={"text": "hi"}).status_code == 200
        os.remove(path)
        answer = client.post("/sessions/c3/messages", json={"text": "again"})
        assert answer.status_code >= 500, answer.text
        assert "the server's log has the details" in answer.json()["message"], answer.text
    logged = [line for line in server.stderr.splitlines() if "'c3'" in line]
    assert logged, server.stderr
    assert any(" WARNING " in line or " ERROR " in line for line in logged), server.stderr
    assert any("deleted or replaced" in line for line in server.stderr.splitlines())


def test_serve_says_when_it_creates_a_new_empty_store(tmp_path: Path) -> None:
    """A SQLite path where no file was (a mistyped path, a file deleted while it was
    stopped) is logged as a new, empty store, naming the path and where the store was
    given (--store, --store-file or SESSIONACTORS_STORE); a file that exists is not;
    --log-level error leaves the warning out."""
    path = tmp_path / "served.db"
    with serve_command(f"sqlite:///{path}") as server:
        pass
    assert f"created a new, empty store at '{path}'" in server.stderr, server.stderr
    assert " WARNING " in server.stderr, server.stderr
    with serve_command(f"sqlite:///{path}") as again:
        pass
    assert "created a new" not in again.stderr, again.stderr
    with serve_command(f"sqlite:///{tmp_path / 'other.db'}", "--log-level", "error") as quiet:
        pass
    assert "created a new" not in quiet.stderr, quiet.stderr
    check = "stop the server and check the path in"
    assert f"{check} --store\n" in server.stderr, server.stderr
    (tmp_path / "store").write_text(f"sqlite:///{tmp_path / 'filed.db'}\n")
    with serve_command(None, "--store-file", str(tmp_path / "store")) as filed:
        pass
    assert f"{check} --store-file {str(tmp_path / 'store')!r}" in filed.stderr, filed.stderr
    variable = {"SESSIONACTORS_STORE": f"sqlite:///{tmp_path / 'variable.db'}"}
    with serve_command(None, env=variable) as from_variable:
        pass
    assert f"{check} SESSIONACTORS_STORE" in from_variable.stderr, from_variable.stderr


@pytest.mark.redis
def test_serve_never_prints_the_password_of_its_store_url(
    private_redis_server: Callable[..., AbstractContextManager[str]],
) -> None:
    """serve's startup line names its Redis store's URL with *** in place of the
    password, and neither its log (at debug, with the access log) nor its refusal of a
    password the server does not take prints the password."""
    secret = "hunter2-Zq9"
    with private_redis_server(config=("--requirepass", secret)) as plain:
        host = plain.removeprefix("redis://")
        url = f"redis://:{secret}@{host}"
        with (
            serve_command(url, "--access-log", "--log-level", "debug") as server,
            httpx.Client(base_url=server.url, timeout=30) as client,
        ):
            assert client.post("/sessions/c1/messages", json={"text": "hi"}).status_code == 200
            assert client.get("/healthz").status_code == 200
        assert secret not in server.line + server.stderr, server.line + server.stderr
        assert f"'redis://:***@{host}'" in server.line, server.line
        assert '"GET /healthz 1.1" 200' in server.stderr, server.stderr
        refused = subprocess.run(
            [sys.executable, "-m", "sessionactors", "serve", "--store",
             f"redis://:wrong-{secret}@{host}", "--agent", "chat_agents:agents", "--port", "0"],
            cwd=HERE,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )  # fmt: skip
    assert refused.returncode == 1, refused.stderr
    assert secret not in refused.stderr + refused.stdout, refused.stderr
    assert f"redis://:***@{host}" in refused.stderr, refused.stderr


def test_serve_refuses_an_unknown_log_level() -> None:
    """--log-level takes debug, info, warning or error; anything else exits with status 2."""
    command = ["serve", "--store", "memory://", "--agent", "chat_agents:agents"]
    done = subprocess.run(
        [sys.executable, "-m", "sessionactors", *command, "--log-level", "loud"],
        cwd=HERE,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "--log-level" in done.stderr, done.stderr


def test_serve_access_log_names_requests_without_their_query(tmp_path: Path) -> None:
    """--access-log writes a line per request (method, path, status) to stderr, without
    the query string, where a browser's ?access_token= would be; without it, none."""
    store = f"sqlite:///{tmp_path / 'served.db'}"
    with (
        serve_command(store, "--access-log", "--token", "s3cret-tok") as server,
        httpx.Client(base_url=server.url, timeout=30) as client,
    ):
        assert client.get("/sessions?access_token=s3cret-tok").status_code == 200
    assert '"GET /sessions 1.1" 200' in server.stderr, server.stderr
    assert "s3cret-tok" not in server.stderr, server.stderr
    with (
        serve_command(store) as plain,
        httpx.Client(base_url=plain.url, timeout=30) as client,
    ):
        assert client.get("/sessions").status_code == 200
    assert "GET /sessions" not in plain.stderr, plain.stderr


def test_serve_access_log_escapes_control_characters_of_the_request(tmp_path: Path) -> None:
    """A request whose path holds percent-encoded control characters (a newline and a
    forged log line, an ANSI escape) is written to the access log on one line, those
    characters escaped: a client cannot forge a line of the server's log, nor reach the
    terminal that reads it."""
    forged = "2026-01-01 00:00:00,000 ERROR sessionactors: forged"
    path = "/sessions/x%0A" + forged.replace(" ", "%20") + "%0D%1B[31mred%C2%9B"
    with (
        serve_command(f"sqlite:///{tmp_path / 'served.db'}", "--access-log") as server,
        httpx.Client(base_url=server.url, timeout=30) as client,
    ):
        assert client.get(path).status_code >= 400
    lines = server.stderr.splitlines()
    assert not any(line.startswith("2026-01-01") for line in lines), server.stderr
    assert not any(ch in server.stderr for ch in "\r\x1b\x9b"), repr(server.stderr)
    logged = [line for line in lines if "forged" in line]  # (hypercorn may write two)
    assert logged, server.stderr
    for line in logged:
        assert line.startswith(tuple("0123456789")), line  # (its own time)
        assert "hypercorn.access" in line, line
        assert "\\u000a2026-01-01" in line, line


def test_serve_that_inherits_sighup_ignored_keeps_serving_through_it(tmp_path: Path) -> None:
    """Started with SIGHUP ignored (under nohup, or by a supervisor that reloads with
    kill -HUP), serve leaves it ignored: a SIGHUP neither stops it nor counts as a first
    signal, so that the SIGTERM after it shuts down gracefully (status 0)."""
    with (
        serve_command(f"sqlite:///{tmp_path / 'served.db'}", launcher=["nohup"]) as server,
        httpx.Client(base_url=server.url, timeout=30) as client,
    ):
        server.process.send_signal(signal.SIGHUP)
        assert client.post("/sessions/s/messages", json={"text": "hi"}).status_code == 200
        assert client.get("/healthz").status_code == 200
    assert "SIGHUP" not in server.stderr, server.stderr
    assert "SIGTERM: shutting down" in server.stderr, server.stderr


def test_serve_shuts_down_gracefully_on_sighup(tmp_path: Path) -> None:
    """SIGHUP (the terminal closed, a supervisor's reload) shuts down as SIGTERM does: the
    session is hibernated to the store and the exit status is 0."""
    path = tmp_path / "served.db"
    with (
        serve_command(f"sqlite:///{path}", stop=signal.SIGHUP) as server,
        httpx.Client(base_url=server.url, timeout=30) as client,
    ):
        assert client.post("/sessions/kept/messages", json={"text": "keep"}).status_code == 200
    assert "SIGHUP: shutting down" in server.stderr, server.stderr

    async def read() -> list[sa.SessionInfo]:
        async with sa.open_registry(store=sa.SQLiteStore(str(path))) as registry:
            return await registry.sessions()

    [info] = trio.run(read)
    assert info.status == sa.Status.HIBERNATED


def test_a_forced_stop_is_logged_and_exits_with_status_1(tmp_path: Path) -> None:
    """A second SIGTERM while a turn runs stops at once, says on stderr that the stop was
    forced, and exits with status 1, so that a supervisor tells it from a clean stop."""
    long_text = " ".join(f"w{i}" for i in range(1000))  # 50 s of words
    with (
        serve_command(
            f"sqlite:///{tmp_path / 'served.db'}", "--shutdown-grace", "100", status=1
        ) as server,
        httpx.Client(base_url=server.url, timeout=60) as client,
    ):

        def send() -> None:
            with contextlib.suppress(httpx.HTTPError):  # (cut by the second signal)
                client.post("/sessions/s/messages", json={"text": long_text})

        sending = threading.Thread(target=send)
        sending.start()
        deadline = time.monotonic() + 30
        while client.get("/sessions/s").json().get("status") != "running":
            assert time.monotonic() < deadline, "the turn did not start"
            time.sleep(0.05)
        server.process.send_signal(signal.SIGTERM)
        assert server.process.stderr is not None
        while "shutting down" not in (line := server.process.stderr.readline()):
            assert line, "serve said nothing of its shutdown"
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(timeout=60)
        sending.join(timeout=30)
    assert server.process.returncode == 1
    assert "stopped at once" in server.stderr, server.stderr


@pytest.mark.parametrize("otel", [True, False], ids=["otel", "control-without"])
def test_serve_reports_through_opentelemetry_with_otel(tmp_path: Path, otel: bool) -> None:
    """serve --otel reports each turn's spans through OpenTelemetry's global providers,
    which the --agent module set up (as an app does, or opentelemetry-instrument);
    without --otel nothing is reported (the control)."""
    spans = tmp_path / "spans"
    spans.touch()
    extra = ["--agent", "otel_agents:agents", *(["--otel"] if otel else [])]
    with (
        serve_command(f"sqlite:///{tmp_path / 'served.db'}", *extra, env={"SPANS_FILE": str(spans)}) as server,
        httpx.Client(base_url=server.url, timeout=30) as client,
    ):  # fmt: skip
        answer = client.post("/sessions/traced/messages", json={"text": "hello there"})
        assert answer.status_code == 200, answer.text
    names = spans.read_text().splitlines()
    if otel:
        assert any(name.startswith("invoke_agent ") for name in names), names
        assert any(name.startswith("chat ") for name in names), names
    else:
        assert names == []


@pytest.mark.parametrize("how", ["env", "env-spaced", "file", "file-bom-crlf"])
def test_serve_reads_its_token_from_the_environment_or_a_file(tmp_path: Path, how: str) -> None:
    """The token can come from SESSIONACTORS_TOKEN or --token-file (either one's
    surrounding whitespace, a trailing newline, dropped alike; a file's byte order mark
    too, as Windows editors write one), so that it never shows in the process list:
    requests without it get 401."""
    token = "env-s3cret"
    extra: list[str] = []
    env = {"SESSIONACTORS_TOKEN": f" {token}\n" if how == "env-spaced" else token}
    if how.startswith("file"):
        text = f"{token}\n" if how == "file" else f"\ufeff{token}\r\n"
        (tmp_path / "token").write_text(text, encoding="utf-8", newline="")
        extra, env = ["--token-file", str(tmp_path / "token")], {}
    with (
        serve_command(f"sqlite:///{tmp_path / 'served.db'}", *extra, env=env) as server,
        httpx.Client(base_url=server.url, timeout=30) as client,
    ):
        assert client.get("/sessions").status_code == 401
        headers = {"authorization": f"Bearer {token}"}
        assert client.get("/sessions", headers=headers).status_code == 200
        with open(f"/proc/{server.process.pid}/cmdline", "rb") as cmdline:
            assert token.encode() not in cmdline.read()


@pytest.mark.parametrize(
    ("args", "content", "said"),
    [
        (["--token-file", "{dir}/missing"], None, "--token-file"),
        (["--token-file", "{dir}/token"], "\n", "empty"),
        (["--token-file", "{dir}/token", "--token", "x"], "x", "not both"),
        ([], None, "SESSIONACTORS_TOKEN is set but empty"),
        (["--token-file", "/dev/zero"], None, "holds over 65,536 characters"),
        (["--token-file", "{dir}/token"], "s3cret\nmore\n", "more than one line"),
    ],
    ids=["missing", "empty", "both", "empty-variable", "endless", "two-lines"],
)
def test_serve_refuses_a_token_file_it_cannot_use(
    tmp_path: Path, args: list[str], content: str | None, said: str
) -> None:
    """A token file that is missing, empty, endless (a device, or a large file given by
    mistake: it was read to its end, without bound), of more than one line (no header
    carries such a token), or given with --token, or a SESSIONACTORS_TOKEN set but empty
    (an empty bearer token would match it), exits with status 2 and says why, never
    what the file holds."""
    if content is not None:
        (tmp_path / "token").write_text(content)
    command = ["serve", "--store", "memory://", "--agent", "chat_agents:agents", "--port", "0"]
    command += [arg.format(dir=tmp_path) for arg in args]
    done = subprocess.run(
        [sys.executable, "-m", "sessionactors", *command],
        cwd=HERE,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "SESSIONACTORS_TOKEN": ""} if not args else None,
    )
    assert done.returncode == 2, done.stderr
    assert said in done.stderr, done.stderr
    assert "s3cret" not in done.stderr, done.stderr


@pytest.mark.redis
@pytest.mark.parametrize("how", ["env", "file", "argument"])
def test_serve_reads_its_store_url_from_the_environment_or_a_file(
    private_redis_server: Callable[..., AbstractContextManager[str]], tmp_path: Path, how: str
) -> None:
    """The store's URL can come from SESSIONACTORS_STORE or --store-file (its surrounding
    whitespace dropped), so that the password of a redis-server that requires one never
    shows in the process list, where --store URL shows it (the control), nor in serve's
    output."""
    secret = "hunter2-Zq9"
    with private_redis_server(config=("--requirepass", secret)) as plain:
        host = plain.removeprefix("redis://")
        url = f"redis://:{secret}@{host}"
        store: str | None = None
        extra: list[str] = []
        env = {"SESSIONACTORS_STORE": f" {url}\n"}
        if how == "file":
            (tmp_path / "store").write_text(f"{url}\n")
            extra, env = ["--store-file", str(tmp_path / "store")], {}
        elif how == "argument":
            store, env = url, {}
        with (
            serve_command(store, *extra, env=env) as server,
            httpx.Client(base_url=server.url, timeout=30) as client,
        ):
            answer = client.post("/sessions/c1/messages", json={"text": "hi"})
            assert answer.status_code == 200, answer.text
            with open(f"/proc/{server.process.pid}/cmdline", "rb") as cmdline:
                shown = secret.encode() in cmdline.read()
        assert shown == (how == "argument")
        assert secret not in server.line + server.stderr, server.line + server.stderr
        assert f"'redis://:***@{host}'" in server.line, server.line


@pytest.mark.parametrize(
    ("args", "content", "variable"),
    [
        (["--store", "memory://"], None, "nonsense://"),
        (["--store-file", "{dir}/store"], "memory://", "nonsense://"),
    ],
    ids=["store", "store-file"],
)
def test_serve_takes_an_explicit_store_over_the_environment(
    tmp_path: Path, args: list[str], content: str | None, variable: str
) -> None:
    """--store and --store-file win over SESSIONACTORS_STORE (here a URL that names no
    store): the server starts on the store they name."""
    if content is not None:
        (tmp_path / "store").write_text(content)
    extra = [arg.format(dir=tmp_path) for arg in args]
    env = {"SESSIONACTORS_STORE": variable}
    with (
        serve_command(None, *extra, env=env) as server,
        httpx.Client(base_url=server.url, timeout=30) as client,
    ):
        assert client.post("/sessions/c1/messages", json={"text": "hi"}).status_code == 200


#: A password that a refused store URL or store file holds, which no refusal may print.
STORE_SECRET = "hunter2-Zq9"


@pytest.mark.parametrize(
    ("args", "content", "variable", "said"),
    [
        (["--store-file", "{dir}/missing"], None, None, "--store-file '{dir}/missing'"),
        (["--store-file", "{dir}"], None, None, "--store-file '{dir}'"),
        (["--store-file", "{dir}/store"], " \n\n", None, "--store-file '{dir}/store' is empty"),
        (
            ["--store-file", "{dir}/store"],
            f"redis://:{STORE_SECRET}@h:6379/0\nredis://:{STORE_SECRET}@h:6379/1\n",
            None,
            "--store-file '{dir}/store' holds more than one line",
        ),
        (
            ["--store-file", "{dir}/store"],
            f"redis//:{STORE_SECRET}@h:6379/0\n",
            None,
            "--store-file '{dir}/store' holds 'redis//:***@h:6379/0'",
        ),
        (["--store", "memory://", "--store-file", "{dir}/store"], "memory://", None, "not both"),
        ([], None, "", "SESSIONACTORS_STORE is set but empty"),
        ([], None, f"redis//:{STORE_SECRET}@h:6379/0", "SESSIONACTORS_STORE 'redis//:***@h"),
        ([], None, None, "--store"),
    ],
    ids=[
        "missing",
        "directory",
        "empty",
        "two-lines",
        "not-a-url",
        "both",
        "empty-variable",
        "bad-variable",
        "none",
    ],
)
def test_serve_refuses_a_store_file_or_variable_it_cannot_use(
    tmp_path: Path, args: list[str], content: str | None, variable: str | None, said: str
) -> None:
    """A store file that is missing, no file, empty or of more than one line, one given
    with --store, a SESSIONACTORS_STORE set but empty, a URL in either that names no
    store, or no store given at all, exits with status 2 and says why, naming the file or
    the variable and never printing a password."""
    if content is not None:
        (tmp_path / "store").write_text(content)
    command = ["serve", "--agent", "chat_agents:agents", "--port", "0"]
    command += [arg.format(dir=tmp_path) for arg in args]
    env = {key: value for key, value in os.environ.items() if key != "SESSIONACTORS_STORE"}
    if variable is not None:
        env["SESSIONACTORS_STORE"] = variable
    done = subprocess.run(
        [sys.executable, "-m", "sessionactors", *command],
        cwd=HERE,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )
    assert done.returncode == 2, done.stderr
    assert said.format(dir=tmp_path) in done.stderr, done.stderr
    assert STORE_SECRET not in done.stderr + done.stdout, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr


async def test_healthz_answers_200_while_the_store_answers_and_503_when_it_fails(
    serve: Serve,
) -> None:
    """GET /healthz answers 200 with no token needed while the registry is open and its
    store answers, 503 once the store fails, telling nothing but whether it is ok."""
    store = FaultyStore()
    async with (
        serve(store=store, token="s3cret") as served,
        httpx.AsyncClient(base_url=served.url) as client,
    ):
        with trio.fail_after(30):
            ok = await client.get("/healthz")
            assert ok.status_code == 200, ok.text
            assert ok.json() == {"status": "ok"}
            assert (await client.get("/sessions")).status_code == 401
            store.fail("list_sessions", times=None, error=sa.StoreError("down (a test's)"))
            down = await client.get("/healthz")
            assert down.status_code == 503, down.text
            assert down.json() == {"status": "unavailable"}
            store.fail("list_sessions", times=0)
            assert (await client.get("/healthz")).status_code == 200


class _Probes:
    """An ASGI app around the gateway that counts the ``GET /healthz`` requests that
    reached it, and notes the asyncio loop that runs it (None under trio)."""

    def __init__(self) -> None:
        self.app: Any = None
        self.entered = 0
        self.loop: asyncio.AbstractEventLoop | None = None

    def around(self, app: Any) -> "_Probes":
        self.app = app
        return self

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/healthz":
            self.entered += 1
            if sniffio.current_async_library() == "asyncio":
                self.loop = asyncio.get_running_loop()
        await self.app(scope, receive, send)

    async def settled(self) -> None:
        """Return once the requests that reached the app ran as far as they go without
        waiting on another task: under trio (this test's run), once every task waits;
        under asyncio, after a few turns of its loop, which the requests need to reach
        the health route's wait from here (no I/O in between)."""
        loop = self.loop
        if loop is None:
            await trio.testing.wait_all_tasks_blocked()
            return

        async def turns() -> None:
            for _ in range(20):
                await asyncio.sleep(0)

        await trio.to_thread.run_sync(
            lambda: asyncio.run_coroutine_threadsafe(turns(), loop).result(10)
        )


async def test_concurrent_healthz_probes_share_one_read_of_the_store(serve: Serve) -> None:
    """GET /healthz probes that come while a check of the store runs wait for that
    check's answer instead of reading the store each: a burst of probes is one read.
    An answer is not kept once its check ended: the first probe after the store failed
    is told 503, and the first after it recovered 200."""
    store, probes, burst = FaultyStore(), _Probes(), 8
    async with (
        serve(store=store, wrap=probes.around) as served,
        httpx.AsyncClient(base_url=served.url, timeout=30) as client,
    ):
        with trio.fail_after(30):
            assert (await client.get("/healthz")).status_code == 200
            reads = store.calls["list_sessions"]
            gate = store.hold("list_sessions")
            answers: list[int] = []

            async def probe() -> None:
                answers.append((await client.get("/healthz")).status_code)

            async with trio.open_nursery() as nursery:
                for _ in range(burst):
                    nursery.start_soon(probe)
                while probes.entered < 1 + burst or not gate.waiting:
                    await trio.sleep(0.01)
                await probes.settled()
                held = gate.waiting
                gate.open()
            assert answers == [200] * burst
            assert (held, store.calls["list_sessions"] - reads) == (1, 1)
            store.fail("list_sessions", times=None, error=sa.StoreError("down (a test's)"))
            assert (await client.get("/healthz")).status_code == 503
            store.fail("list_sessions", times=0)
            assert (await client.get("/healthz")).status_code == 200
            assert store.calls["list_sessions"] - reads == 3


async def test_healthz_probes_waiting_on_a_check_are_told_503_once_the_server_drains(
    serve: Serve,
) -> None:
    """A GET /healthz probe is never told 200 once the server began to drain, not even
    by a check of the store that began before and answered after."""
    store, probes = FaultyStore(), _Probes()
    async with (
        serve(store=store, wrap=probes.around) as served,
        httpx.AsyncClient(base_url=served.url, timeout=30) as client,
    ):
        with trio.fail_after(30):
            gate = store.hold("list_sessions")
            answers: list[int] = []

            async def probe() -> None:
                answers.append((await client.get("/healthz")).status_code)

            async with trio.open_nursery() as nursery:
                for _ in range(2):
                    nursery.start_soon(probe)
                while probes.entered < 2 or not gate.waiting:
                    await trio.sleep(0.01)
                await probes.settled()
                served.app.drain()
                gate.open()
            assert answers == [503, 503]


@pytest.mark.one_server  # (slow)
async def test_healthz_answers_503_when_the_store_does_not_answer(serve: Serve) -> None:
    """GET /healthz answers 503 when the store does not answer within its bound, instead
    of holding the load balancer's probe: so do the probes that wait on that read."""
    store = FaultyStore()
    async with (
        serve(store=store) as served,
        httpx.AsyncClient(base_url=served.url, timeout=30) as client,
    ):
        gate = store.hold("list_sessions")
        answers: list[int] = []

        async def probe() -> None:
            answers.append((await client.get("/healthz")).status_code)

        try:
            with trio.fail_after(30):
                async with trio.open_nursery() as nursery:
                    for _ in range(3):
                        nursery.start_soon(probe)
                assert answers == [503] * 3
        finally:
            gate.open()


async def test_healthz_answers_503_while_draining(serve: Serve) -> None:
    """GET /healthz answers 503 once the app drains (a shutdown began), so that a load
    balancer sends no more requests there."""
    async with (
        serve() as served,
        httpx.AsyncClient(base_url=served.url) as client,
    ):
        with trio.fail_after(30):
            assert (await client.get("/healthz")).status_code == 200
            served.app.drain()
            assert (await client.get("/healthz")).status_code == 503


def test_a_request_refused_as_the_server_stops_is_logged_in_one_line_not_as_an_error(
    tmp_path: Path,
) -> None:
    """A request whose turn the shutdown cut off is answered 503 (SessionStoppedError) and
    logged in one line below ERROR, without a traceback: a deploy trips no alert on
    ERROR (the cut turn itself is logged at WARNING)."""
    long_text = " ".join(f"w{i}" for i in range(1000))  # 50 s of words: outlasts the grace
    started = threading.Event()
    answer: list[httpx.Response | Exception] = []
    with (
        serve_command(f"sqlite:///{tmp_path / 'served.db'}", "--shutdown-grace", "0") as server,
        httpx.Client(base_url=server.url, timeout=60) as client,
    ):
        assert client.post("/sessions/cut/messages", json={"text": "hi"}).status_code == 200

        def listen() -> None:
            with (
                httpx.Client(base_url=server.url, timeout=60) as listener,
                listener.stream("GET", "/sessions/cut/events?after=0") as response,
            ):
                for line in response.iter_lines():
                    if "TurnStarted" in line and "w999" in line:
                        started.set()  # and read on, until the server ends the stream

        def send() -> None:
            try:
                answer.append(client.post("/sessions/cut/messages", json={"text": long_text}))
            except httpx.HTTPError as exc:
                answer.append(exc)

        threads = [threading.Thread(target=listen), threading.Thread(target=send)]
        for thread in threads:
            thread.start()
        assert started.wait(timeout=30)
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(timeout=60)
        for thread in threads:
            thread.join(timeout=30)
    [response] = answer
    assert isinstance(response, httpx.Response), response
    assert (response.status_code, response.json()["error"]) == (503, "SessionStoppedError")
    assert " ERROR " not in server.stderr, server.stderr
    assert "Traceback" not in server.stderr, server.stderr
    # (the status as a word: a turn id's hex digits may hold "503")
    told = [line for line in server.stderr.splitlines() if re.search(r"\b503\b", line)]
    assert len(told) == 1, server.stderr
    assert " INFO sessionactors.http: " in told[0], told[0]
    assert "SessionStoppedError" in told[0], told[0]
    assert "'cut'" in told[0], told[0]


def test_serve_logs_its_worker_id_as_it_starts(tmp_path: Path) -> None:
    """A server whose store other workers share logs the worker id that its leases and
    other workers' errors name in its startup line on stderr, as on stdout."""
    store = f"sqlite:///{tmp_path / 'served.db'}?shared=true"
    with serve_command(store) as server:
        pass
    worker = server.line.split(" as worker ", 1)[1].split()[0]
    logged = [line for line in server.stderr.splitlines() if f"worker {worker}" in line]
    assert len(logged) == 1, server.stderr
    assert " INFO sessionactors.http: serving " in logged[0], logged[0]
    assert server.url in logged[0], logged[0]


def test_serve_access_log_gives_event_streams_the_status_they_began_with(tmp_path: Path) -> None:
    """An event stream (GET .../events, a turn streamed to Accept: text/event-stream) is
    written to the access log with the status it began with, also when its client left
    first or the server's stop ended it."""
    with (
        serve_command(f"sqlite:///{tmp_path / 'served.db'}", "--access-log") as server,
        httpx.Client(base_url=server.url, timeout=30) as client,
    ):
        assert client.post("/sessions/s1/messages", json={"text": "hi"}).status_code == 200
        with client.stream("GET", "/sessions/s1/events?after=0") as response:
            assert response.status_code == 200
            next(response.iter_lines())  # and leave
        sse = {"accept": "text/event-stream"}
        with client.stream("POST", "/sessions/s1/messages", json={"text": "a b"}, headers=sse) as r:
            assert r.status_code == 200
            assert "TurnFinished" in r.read().decode()
        with client.stream("GET", "/sessions/s1/events?after=0") as response:
            read = response.iter_lines()
            next(read)
            server.process.send_signal(signal.SIGTERM)  # (the stop ends the stream)
            for _ in read:
                pass
        server.process.wait(timeout=60)
    lines = [line for line in server.stderr.splitlines() if "hypercorn.access" in line]
    events = [line for line in lines if '"GET /sessions/s1/events 1.1"' in line]
    assert len(events) == 2, server.stderr
    for line in events:
        assert '"GET /sessions/s1/events 1.1" 200 ' in line, line
    streamed = [line for line in lines if '"POST /sessions/s1/messages 1.1"' in line]
    assert len(streamed) == 2, server.stderr
    for line in streamed:
        assert '"POST /sessions/s1/messages 1.1" 200 ' in line, line
