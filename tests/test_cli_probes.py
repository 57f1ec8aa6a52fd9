"""Probes of ``python -m sessionactors`` at its edges, as an operator or an attacker runs
it: hostile text in what it prints, a closed standard output, a reader that stops, a
store that goes away for a moment, Ctrl-C at a prompt and arguments that make no sense."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import trio

import forked_cli
import sessionactors as sa
from models.fake_openai_server import open_fake_openai, text_reply
from net_proxy import proxy_to
from processes import reap
from sessionactors.http import create_app
from sessionactors.stores import RedisStore
from sessionactors.testing import EchoModel
from web.served import LOG_LINE

#: What a session's text may hold to take over a terminal: an ANSI escape (clear the
#: screen), a carriage return, a C1 CSI (which JSON leaves raw), a bidirectional override
#: and an OSC that sets the window's title.
HOSTILE = "x\x1b[2J\ry\x9b31m\u202eevil\x1b]0;owned\x07\nnext line"
PYTHON_M = (sys.executable, "-m", "sessionactors")
#: The same, with Ctrl-C's default handler whatever the test run's disposition of
#: SIGINT: a run started in the background of a shell without job control ignores
#: SIGINT, and its children inherit that (Python then installs no handler).
PYTHON_M_CTRL_C = (
    sys.executable,
    "-c",
    "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "runpy.run_module('sessionactors', run_name='__main__', alter_sys=True)",
)
RAW = ("\x1b", "\r", "\x9b", "\u202e", "\x07")


def command(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m sessionactors ARGS``, its input empty (in a process that
    ``forked_cli`` forks)."""
    return forked_cli.run(args, env=env, cwd=cwd)


def one_line(done: subprocess.CompletedProcess[str], status: int) -> str:
    """The one line on stderr of a command that failed with ``status``, no traceback
    (besides the lines of serve's log, each with its time and level)."""
    assert done.returncode == status, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    said = "".join(line for line in done.stderr.splitlines(True) if not LOG_LINE.match(line))
    assert said.count("\n") == 1, done.stderr
    return said


async def _hostile_session(path: Path) -> None:
    agent = sa.Agent(model=EchoModel(), system_prompt=f"prompt {HOSTILE}")
    async with sa.open_registry(store=sa.SQLiteStore(path), agents={"echo": agent}) as registry:
        ref = await registry.spawn("h", metadata={"note": HOSTILE})
        await ref.send(HOSTILE)


def test_what_a_session_holds_never_reaches_the_terminal_raw(tmp_path: Path) -> None:
    """show, tail and export print no control character that a session's messages,
    metadata or system prompt hold (an ANSI escape, a C1 CSI, a bidi override): show
    writes them escaped (a message's own lines indented under it), and the JSON of tail
    and export escapes them, as JSON that still reads back to the exact text."""
    path = tmp_path / "s.db"
    trio.run(_hostile_session, path)
    store = f"sqlite:///{path}"
    shown = command("sessions", "show", "h", "--store", store)
    tailed = command("sessions", "tail", "h", "--no-follow", "--store", store)
    exported = command("sessions", "export", "h", "--store", store)
    for done in (shown, tailed, exported):
        assert done.returncode == 0, done.stderr
        assert not [ch for ch in RAW if ch in done.stdout], done.stdout
    assert "\\u001b[2J" in shown.stdout
    assert "        next line" in shown.stdout  # (not a line of its own, as a message is)
    events = [json.loads(line) for line in tailed.stdout.splitlines()]
    assert [e["text"] for e in events if e["type"] == "TurnStarted"] == [HOSTILE]
    session = json.loads(exported.stdout)["session"]
    assert [m["content"] for m in session["messages"]] == [HOSTILE, HOSTILE]
    assert session["metadata"] == {"note": HOSTILE}


def test_a_closed_standard_output_is_one_line_and_nothing_done(tmp_path: Path) -> None:
    """A sessions command started with standard output closed (``>&-``) says so in one
    line, rather than an AttributeError, and writes nothing: an import creates no store."""
    target = tmp_path / "target.db"
    document = tmp_path / "missing-is-fine.json"
    args = ["sessions", "import", str(document), "--store", f"sqlite:///{target}"]
    done = subprocess.run(
        ["sh", "-c", 'exec "$@" >&-', "sh", *PYTHON_M, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert "standard output is closed" in one_line(done, 1)
    assert not target.exists()


@pytest.mark.parametrize(
    ("args", "status", "expected"),
    [
        # (an import into a store of the command's own process would be lost at its end)
        (["sessions", "import", "-", "--store", "memory://"], 1, "store inside one process"),
        (["sessions", "list", "--store", "sqlite:///{tmp}"], 1, "is a directory"),
        (["serve", "--store", "sqlite:///{tmp}", "--agent", "agents:a"], 1, "is a directory"),
        (["chat", "--base-url", "http://x/v1", "--model", "m", "--db", "{tmp}"], 1, "directory"),
        (["demo", "--sessions", "0"], 2, "--sessions"),
        (["demo", "--turns", "-1"], 2, "--turns"),
        (["demo", "--path", "{tmp}/s.db"], 2, "exists"),  # never into a real store
        (["demo", "--sessions", "4", "--path", "{tmp}/no/such/dir.db"], 1, "no/such"),
        (["serve", "--store", "memory://", "--agent", "agents:a", "--port", "70000"], 2, "port"),
        (["serve", "--store", "memory://", "--agent", "broken:a"], 2, "SyntaxError"),
        (["serve", "--store", "memory://", "--agent", "raising:a"], 2, "boom at import"),
        (["serve", "--store", "memory://", "--agent", "nosuchmodule:a"], 2, "--agent"),
        (["serve", "--store", "memory://", "--agent", "agents:a", "--port", "{busy}"], 1, "{busy}"),
        # (as --token "$TOKEN" with TOKEN unset: an empty bearer token would match it)
        (["serve", "--store", "memory://", "--agent", "agents:a", "--token", ""], 2, "--token"),
        # (as --host "$HOST" with HOST unset: it listened on every interface)
        (["serve", "--store", "memory://", "--agent", "agents:a", "--host", ""], 2, "--host"),
    ],
)
def test_bad_arguments_are_one_line_without_a_traceback(
    tmp_path: Path, args: list[str], status: int, expected: str
) -> None:
    """A store URL that cannot work, a demo count that is too small or a demo file that
    exists, a port out of range or in use, an agent module that does not import: one line
    naming what is wrong, exit status 2 for an argument and 1 otherwise."""
    (tmp_path / "s.db").write_bytes(b"")
    (tmp_path / "agents.py").write_text(
        "import sessionactors as sa\nfrom sessionactors.testing import EchoModel\n"
        "a = sa.Agent(model=EchoModel())\n"
    )
    (tmp_path / "broken.py").write_text("a = (\n")
    (tmp_path / "raising.py").write_text("raise RuntimeError('boom at import')\n")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        args = [a.replace("{tmp}", str(tmp_path)).replace("{busy}", port) for a in args]
        done = command(*args, cwd=tmp_path)
    line = one_line(done, status)
    assert expected.replace("{busy}", port) in line, line
    assert "serving" not in done.stdout


@pytest.mark.parametrize(
    ("args", "prog"),
    [
        (
            ["sessions", "export", "a", "--json", "--store", "memory://"],
            "sessionactors sessions export",
        ),
        (
            ["serve", "--store", "memory://", "--agent", "agents:a", "--workers", "3"],
            "sessionactors serve",
        ),
        (["--bogus", "sessions", "list", "--store", "memory://"], "sessionactors"),
    ],
)
def test_an_option_a_command_does_not_take_is_named_with_that_command(
    tmp_path: Path, args: list[str], prog: str
) -> None:
    """An option a command does not take (``export --json``, ``serve --workers``) is
    refused in one line that names that command and its --help, which lists the options
    it does take, rather than the top command, whose --help lists none of them."""
    done = command(*args, cwd=tmp_path)
    line = one_line(done, 2)
    assert line.startswith(f"{prog}: unrecognized arguments: "), line
    assert line.rstrip().endswith(f"(see {prog} --help)"), line


#: A store URL's password that the command line must never print.
SECRET = "hunter2-Zq9"


@pytest.mark.parametrize(
    "store",
    [
        f"redis:/:{SECRET}@127.0.0.1:1/0",  # (a slash short: no store URL)
        f"postgres://ops:{SECRET}@db.example/sessions",  # (a store it has not)
        f"sqlite://ops:{SECRET}@sessions.db",  # (a sqlite URL that names no path)
        f"sqlite:///sessions.db?password={SECRET}",  # (an option sqlite does not take)
        f"redis://default:{SECRET}@127.0.0.1:1/0?nosuchoption=1",
    ],
)
def test_a_store_url_that_is_refused_is_named_without_its_password(
    tmp_path: Path, store: str
) -> None:
    """A --store that sessions or serve cannot use is refused in one line that names it
    with *** in place of its password, however the URL holds one."""
    for args in (
        ["sessions", "list", "--store", store],
        ["serve", "--store", store, "--agent", "agents:a"],
    ):
        done = command(*args, cwd=tmp_path)
        line = one_line(done, 2)  # (an argument it cannot use, for every command)
        assert SECRET not in done.stderr + done.stdout, done.stderr
        assert "***" in line, line


def test_arguments_a_command_does_not_take_are_named_without_a_password(tmp_path: Path) -> None:
    """Arguments a command does not take are named in its refusal with *** in place of
    the password of any URL among them (a store URL given to a misspelt option)."""
    url = f"redis://:{SECRET}@127.0.0.1:6379/0"
    for args, shown in [
        (["sessions", "list", "--store", "memory://", "--stroe-url", url], "--stroe-url "),
        (["serve", "--store", "memory://", "--agent", "agents:a", f"--redis={url}"], "--redis="),
    ]:
        done = command(*args, cwd=tmp_path)
        line = one_line(done, 2)
        assert SECRET not in done.stderr, done.stderr
        assert f"unrecognized arguments: {shown}redis://:***@127.0.0.1:6379/0" in line, line


#: Arguments that put a secret where a command refuses it (a misspelt option's value, a
#: value given to a flag, an option before the command, a short option with its value
#: attached, a secret that begins with "-"), each with what its refusal shows instead.
SECRET_REFUSALS: list[tuple[list[str], str]] = [
    (["serve", "--store", "memory://", "--agent", "agents:a", f"--tok={SECRET}"], "unrecognized arguments: --tok=***"),
    (["serve", "--store", "memory://", "--agent", "agents:a", "--tokn", SECRET], "unrecognized arguments: --tokn ***"),
    (["serve", "--store", "memory://", "--agent", "agents:a", "--tokn", f"-{SECRET}"], "ignored explicit argument '***'"),
    (["serve", "--store", "memory://", "--agent", "agents:a", f"-t{SECRET}"], "unrecognized arguments: -t***"),
    (["sessions", "list", "--store", "memory://", "--pasword", SECRET, "extra"], "unrecognized arguments: --pasword *** extra"),
    (["sessions", "list", "--store", "memory://", "--json", SECRET], "unrecognized arguments: ***"),
    (["sessions", "list", "--store", "memory://", f"--json={SECRET}"], "ignored explicit argument '***'"),
    (["--token", SECRET, "serve", "--store", "memory://", "--agent", "agents:a"], "invalid choice: '***'"),
    (["sessions", "--tokn", SECRET, "list"], "invalid choice: '***'"),
    (["serve", "--store", "memory://", "--agent", "agents:a", "--port", SECRET], "'***' is not a whole number"),
    (["sessions", "list", "--store", "memory://", "--limit", SECRET], "'***' is not a whole number"),
]  # fmt: skip


@pytest.mark.parametrize(("args", "shown"), SECRET_REFUSALS)
def test_a_secret_given_where_a_command_refuses_it_is_not_shown(
    tmp_path: Path, args: list[str], shown: str
) -> None:
    """A secret given where the command line refuses it (to a misspelt option, to a
    flag, before the command) is not repeated in the refusal, which shows *** in its
    place and still names the option."""
    done = command(*args, cwd=tmp_path)
    line = one_line(done, 2)
    assert SECRET not in done.stderr + done.stdout, done.stderr
    assert SECRET[2:-2] not in done.stderr, done.stderr
    assert shown in line, line


def test_a_misspelt_command_or_choice_is_still_named() -> None:
    """A plain word that is not a command, a choice or an argument is named in the
    refusal (it is no secret: the user needs to see what was not taken)."""
    for args, shown in [
        (["serv"], "invalid choice: 'serv'"),
        (["sessions", "lists"], "invalid choice: 'lists'"),
        (["sessions", "list", "--store", "memory://", "--status", "runing"], "invalid choice: 'runing'"),
        (["sessions", "list", "--store", "memory://", "extra"], "unrecognized arguments: extra"),
        (["serve", "--store", "memory://", "--agent", "agents:a", "--port", "70000"], "'70000' is not a port"),
    ]:  # fmt: skip
        line = one_line(command(*args), 2)
        assert shown in line, line


#: A store URL holding the password, and one whose password holds a space and a quote
#: (which a message that quotes it as Python does must not cut short).
URLS = (f"redis://:{SECRET}@127.0.0.1:6379/0", f"redis://:{SECRET} it's@127.0.0.1:6379/0")


def refusals_with_a_password(url: str) -> list[list[str]]:
    """Arguments that each parser of the command line refuses, each holding ``url``: a
    command it does not have (an invalid choice), an abbreviation of the two options
    --store and --store-file, a value an option does not take (a choice, a number, a
    value given to a flag) and an argument it does not take."""
    serve = ["serve", "--agent", "agents:a"]
    return [
        [url],
        ["sessions", url, "list"],
        ["sessions", "list", f"--stor={url}"],
        ["sessions", "list", "--stor", url],
        ["sessions", "list", f"--status={url}"],
        ["sessions", "list", "--limit", url],
        ["sessions", "list", "--store", "memory://", url],
        ["sessions", "show", "a", f"--stor={url}"],
        ["sessions", "show", "a", f"--json={url}"],
        ["sessions", "show", "a", url],
        ["sessions", "export", "a", f"--stor={url}"],
        ["sessions", "export", "a", url],
        ["sessions", "import", "-", f"--stor={url}"],
        ["sessions", "import", "-", url],
        ["sessions", "delete", "a", f"--stor={url}"],
        ["sessions", "delete", "a", f"--yes={url}"],
        ["sessions", "delete", "a", url],
        ["sessions", "tail", "a", f"--stor={url}"],
        ["sessions", "tail", "a", "--after", url],
        ["sessions", "tail", "a", f"--no-follow={url}"],
        ["sessions", "tail", "a", url],
        [*serve, f"--stor={url}"],
        [*serve, "--log-level", url],
        [*serve, "--port", url],
        [*serve, url],
    ]


def test_every_parser_refuses_arguments_without_the_password_of_a_url_among_them(
    tmp_path: Path,
) -> None:
    """Whatever each command's parser refuses (a command it has not, an abbreviation that
    --store and --store-file share, a value an option does not take, an argument it does
    not take), its one line names what was wrong with *** in place of the password of a
    store URL in it, never the password."""
    env = {key: value for key, value in os.environ.items() if key != "SESSIONACTORS_STORE"}
    for args in [args for url in URLS for args in refusals_with_a_password(url)]:
        done = command(*args, cwd=tmp_path, env=env)
        line = one_line(done, 2)
        assert SECRET not in done.stdout + done.stderr, (args, done.stderr)
        assert "redis://:***@127.0.0.1:6379/0" in line, (args, line)


def test_the_demo_ends_quietly_when_its_reader_stops(tmp_path: Path) -> None:
    """``demo | head -1``: the demo ends with the status of a closed pipe (141), no
    traceback."""
    script = f'"{sys.executable}" -m sessionactors demo --sessions 4 --turns 1 | head -1'
    script += '; exit "${PIPESTATUS[0]}"'
    done = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.stdout.startswith("== sessionactors demo: 4 sessions")
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 141, done.stderr


async def test_chat_stops_at_once_on_ctrl_c_and_escapes_the_model_text(tmp_path: Path) -> None:
    """chat prints the model's text with its control characters escaped (a reply must
    not drive the terminal), and Ctrl-C at the prompt ends it at once with status 130 and
    no traceback, rather than at the next line typed."""
    async with open_fake_openai() as server:
        server.push(text_reply("Hi", " \x1b[2Jthere\x9b"))
        args = [
            "chat",
            "--base-url",
            server.base_url,
            "--model",
            "m",
            "--db",
            str(tmp_path / "c.db"),
        ]
        process = await trio.lowlevel.open_process(
            [*PYTHON_M_CTRL_C, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert process.stdin is not None
        assert process.stdout is not None
        assert process.stderr is not None
        try:
            with trio.fail_after(60):
                out = b""
                await process.stdin.send_all(b"hello\n")
                while b"there" not in out:
                    chunk = await process.stdout.receive_some()
                    assert chunk, out
                    out += chunk
                await trio.sleep(0.3)  # (back at the prompt, waiting for a line)
                process.send_signal(signal.SIGINT)
                assert await process.wait() == 130
            rest = b""
            while chunk := await process.stdout.receive_some():
                rest += chunk
            errors = await process.stderr.receive_some()
        finally:
            await reap(process)
    text = (out + rest).decode()
    assert "Hi \\u001b[2Jthere\\u009b" in text
    assert "\x1b" not in text
    assert b"Traceback" not in errors, errors


@pytest.mark.redis
async def test_tail_rides_out_a_store_that_is_away_for_a_moment(redis_url: str) -> None:
    """tail follows a session on Redis through a moment when the store does not answer
    (every command's connection dropped): it says so on stderr, retries, says when the
    store answers again, prints the events stored meanwhile and after, and ends cleanly
    on SIGTERM, rather than ending at the first failed read."""
    db = redis_url.rsplit("/", 1)[1] if redis_url.count("/") > 2 else "0"
    name = f"tail-{uuid.uuid4().hex[:8]}"
    agents = {"echo": sa.Agent(model=EchoModel())}
    async with (
        proxy_to(redis_url) as (proxy, through),
        sa.open_registry(store=RedisStore(redis_url), agents=agents) as registry,
    ):
        ref = await registry.spawn(name)
        await ref.send("before")
        process = await trio.lowlevel.open_process(
            [*PYTHON_M, "sessions", "tail", name, "--after", "0", "--store", f"{through}/{db}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert process.stdout is not None
        assert process.stderr is not None
        out, err = b"", b""

        async def until(
            stream: trio.abc.ReceiveStream, text: bytes, seen: bytes, times: int = 1
        ) -> bytes:
            while seen.count(text) < times:
                chunk = await stream.receive_some()
                assert chunk, seen
                seen += chunk
            return seen

        try:
            with trio.fail_after(60):
                out = await until(process.stdout, b'"TurnFinished"', out)
                proxy.edit = lambda words: None  # away: every command's connection dropped
                err = await until(process.stderr, b"retrying", err)
                await ref.send("meanwhile")
                proxy.edit = None
                err = await until(process.stderr, b"answers again", err)
                await ref.send("after")
                out = await until(process.stdout, b'"TurnFinished"', out, times=3)
                process.send_signal(signal.SIGTERM)
                assert await process.wait() == 0
        finally:
            await reap(process)
        await registry.delete(name)
    events = [json.loads(line) for line in out.decode().splitlines()]
    finished = [e["message"]["content"] for e in events if e["type"] == "TurnFinished"]
    assert finished == ["before", "meanwhile", "after"]
    assert [e["seq"] for e in events] == sorted({e["seq"] for e in events})
    assert b"Traceback" not in err


def test_import_refuses_what_no_export_is_before_reading_it(tmp_path: Path) -> None:
    """import refuses a file larger than any export (a 2 GiB file of nothing, as
    /dev/zero would be) before reading it all, and an import from a standard input that
    is closed, each in one line and with nothing written."""
    huge = tmp_path / "huge.json"
    with huge.open("wb") as file:  # (sparse: no disk used)
        file.truncate(2 * 1024**3)
    target = tmp_path / "target.db"
    store = f"sqlite:///{target}"
    line = one_line(command("sessions", "import", str(huge), "--store", store), 1)
    assert "huge.json" in line
    assert "more than an export" in line
    args = ["sessions", "import", "-", "--store", store]
    done = subprocess.run(
        ["sh", "-c", 'exec "$@" <&-', "sh", *PYTHON_M, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert "standard input is closed" in one_line(done, 1)
    assert not target.exists()


@pytest.mark.parametrize("token", ["", "  "])
def test_an_empty_token_is_refused_rather_than_matched_by_an_empty_bearer(token: str) -> None:
    """create_app(token="") refused nothing: a request with ``?access_token=`` (or
    ``Authorization: Bearer ``) got in. An empty token is now a ValueError that says so."""
    agents = {"echo": sa.Agent(model=EchoModel())}
    with pytest.raises(ValueError, match="empty"):
        create_app(store=sa.MemoryStore(), agents=agents, token=token)


def test_a_session_not_in_the_store_is_named_with_advice_for_the_command_line(
    tmp_path: Path,
) -> None:
    """show (and every sessions command) of a name the store does not hold says so in
    one line and points at `sessions list`, not at the library's registry.spawn()."""
    path = tmp_path / "s.db"
    trio.run(_hostile_session, path)
    done = command("sessions", "show", "nosuch", "--store", f"sqlite:///{path}")
    line = one_line(done, 1)
    assert "'nosuch'" in line
    assert "registry.spawn" not in line
    assert "sessions list" in line


async def _wait_blocked_writing(pid: int) -> None:
    """Until the process's main thread sleeps in a write to a full pipe (Linux)."""
    wchan = Path(f"/proc/{pid}/wchan")
    while not wchan.read_text().endswith("pipe_write"):  # (pipe_write, anon_pipe_write)
        await trio.sleep(0.05)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
async def test_tail_stops_on_a_signal_while_its_reader_has_stopped_reading(
    tmp_path: Path, signum: int
) -> None:
    """tail blocked writing to a pipe that nobody reads any more (a full pipe) stops at
    once on Ctrl-C or SIGTERM, as it does while it waits for events (status 0, no
    traceback), rather than ignoring the signal until the reader reads again."""
    path = tmp_path / "s.db"
    agents = {"echo": sa.Agent(model=EchoModel())}
    async with sa.open_registry(store=sa.SQLiteStore(path), agents=agents) as registry:
        ref = await registry.spawn("big")
        await ref.send("word " * 40_000)  # (its events are more than a pipe holds)
    args = ["sessions", "tail", "big", "--after", "0", "--store", f"sqlite:///{path}"]
    process = await trio.lowlevel.open_process(
        [*PYTHON_M_CTRL_C, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert process.stdout is not None
    assert process.stderr is not None
    try:
        with trio.fail_after(30):
            await _wait_blocked_writing(process.pid)
            process.send_signal(signum)
            assert await process.wait() == 0
            errors = await process.stderr.receive_some()
    finally:
        await reap(process)
    assert b"Traceback" not in errors, errors


@pytest.mark.parametrize("where", ["a-file/d.db"])  # (no/such/...: bad-arguments test)
def test_the_demo_refuses_a_path_it_cannot_create_before_printing_anything(
    tmp_path: Path, where: str
) -> None:
    """demo --path in a directory that does not exist (or under a file) prints nothing
    on standard output and one line naming the path on stderr, with status 1, rather
    than its header first."""
    (tmp_path / "a-file").write_text("")
    done = command("demo", "--sessions", "4", "--turns", "1", "--path", str(tmp_path / where))
    line = one_line(done, 1)
    assert where in line, line
    assert done.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_help_says_what_the_command_and_each_demo_option_is_for() -> None:
    """`sessionactors --help` says what the command is for and where its operator's
    guide is, and `demo --help` explains --sessions and --turns, not just their names."""
    top = command("--help")
    assert top.returncode == 0, top.stderr
    assert "conversations" in top.stdout
    assert "docs/howto/operations.md" in top.stdout
    demo = command("demo", "--help")
    assert demo.returncode == 0, demo.stderr
    assert "how many sessions" in demo.stdout
    assert "turns each session takes" in demo.stdout


async def test_chat_at_a_terminal_shows_a_prompt_and_piped_input_gets_none(
    tmp_path: Path,
) -> None:
    """chat whose input is a terminal prints a prompt before each line it waits for; with
    piped input (a script) it prints none, so its output is only the replies."""
    async with open_fake_openai() as server:
        server.push(text_reply("Hi", " there"))
        server.push(text_reply("Piped", " reply"))
        args = [*PYTHON_M, "chat", "--base-url", server.base_url, "--model", "m"]
        args += ["--db", str(tmp_path / "c.db")]
        controller, terminal = os.openpty()
        try:
            process = await trio.lowlevel.open_process(
                args, stdin=terminal, stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
        finally:
            os.close(terminal)
        assert process.stdout is not None
        assert process.stderr is not None
        try:
            with trio.fail_after(20):
                out = b""
                while not out.endswith(b"> "):
                    chunk = await process.stdout.receive_some()
                    assert chunk, out
                    out += chunk
                os.write(controller, b"hello\n")
                while not out.endswith(b"there\n> "):
                    chunk = await process.stdout.receive_some()
                    assert chunk, out
                    out += chunk
                os.write(controller, b"\n")
                assert await process.wait() == 0
        finally:
            os.close(controller)
            await reap(process)
        piped = await trio.run_process(
            args, stdin=b"again\n\n", capture_stdout=True, capture_stderr=True, check=False
        )
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout.decode().splitlines()[1:] == ["Piped reply"]


@pytest.mark.parametrize("args", [["list"], ["tail", "a"]])  # (one check for all)
def test_a_read_command_on_a_sqlite_file_that_does_not_exist_says_to_check_the_path(
    tmp_path: Path, args: list[str]
) -> None:
    """A read command whose --store names a SQLite file that does not exist (a mistyped
    path) says so in one line and to check the path in --store, and creates no file."""
    store = f"sqlite:///{tmp_path / 'nope.db'}"
    line = one_line(command("sessions", *args, "--store", store), 1)
    assert "nope.db' does not exist" in line, line
    assert "does not exist; check the path in --store" in line, line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command_args", [["serve", "--agent", "agents:a"], ["sessions", "list"]])
@pytest.mark.parametrize("how", ["--store", "SESSIONACTORS_STORE"])
def test_a_bad_store_url_is_a_usage_error_for_every_command(
    tmp_path: Path, command_args: list[str], how: str
) -> None:
    """A store URL that is not one (a scheme no store has) exits with status 2, a usage
    error, from serve and from the sessions commands alike, given with --store or in
    SESSIONACTORS_STORE."""
    env = {k: v for k, v in os.environ.items() if k != "SESSIONACTORS_STORE"}
    args = [*command_args]
    if how == "--store":
        args += ["--store", "ftp://x"]
    else:
        env["SESSIONACTORS_STORE"] = "ftp://x"
    done = command(*args, cwd=tmp_path, env=env)
    assert "not a store URL" in one_line(done, 2)
