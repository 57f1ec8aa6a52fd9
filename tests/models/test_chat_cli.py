"""The ``sessionactors chat`` command against a local OpenAI-compatible server."""

from __future__ import annotations

import sys
from pathlib import Path

import trio

from .fake_openai_server import open_fake_openai, text_reply


async def chat(base_url: str, db: Path, lines: str) -> str:
    result = await trio.run_process(
        [
            sys.executable,
            "-m",
            "sessionactors",
            "chat",
            "--base-url",
            base_url,
            "--model",
            "local",
            "--db",
            str(db),
            "--session",
            "ada",
        ],
        stdin=lines.encode(),
        capture_stdout=True,
        capture_stderr=True,
    )
    return result.stdout.decode()


async def test_chat_streams_replies_and_keeps_the_conversation(tmp_path: Path) -> None:
    """chat streams the server's replies and, run again, continues the same stored conversation."""
    db = tmp_path / "chat.db"
    async with open_fake_openai() as server:
        server.push(text_reply("Hello", " Ada!"), text_reply("Still", " here."))
        with trio.fail_after(60):
            first = await chat(server.base_url, db, "hi\n\n")
            second = await chat(server.base_url, db, "are you there?\n\n")
    assert "session 'ada' (0 messages so far)" in first
    assert "Hello Ada!" in first
    assert "session 'ada' (2 messages so far)" in second
    assert "Still here." in second
    sent = server.requests[-1].body
    assert sent is not None
    assert [m["content"] for m in sent["messages"]] == [
        "You are a helpful assistant.",
        "hi",
        "Hello Ada!",
        "are you there?",
    ]


async def test_chat_shares_a_file_that_a_server_shares(tmp_path: Path) -> None:
    """With --shared, chat runs beside another process that shares the SQLite file
    (leases keep each session to one process); without it, chat is refused with a
    one-line error that says how to share the file."""
    import sessionactors as sa
    from sessionactors.testing import EchoModel

    db = tmp_path / "chat.db"
    agents = {"echo": sa.Agent(model=EchoModel())}
    async with (
        open_fake_openai() as server,
        sa.open_registry(store=sa.SQLiteStore(db, shared=True), agents=agents) as registry,
    ):
        await (await registry.spawn("served", agent="echo")).send("kept")
        server.push(text_reply("Hello", " Ada!"))
        with trio.fail_after(60):
            refused = await trio.run_process(
                [sys.executable, "-m", "sessionactors", "chat", "--base-url", server.base_url,
                 "--model", "local", "--db", str(db), "--session", "ada"],
                stdin=b"hi\n\n", capture_stdout=True, capture_stderr=True, check=False,
            )  # fmt: skip
            shared = await trio.run_process(
                [sys.executable, "-m", "sessionactors", "chat", "--base-url", server.base_url,
                 "--model", "local", "--db", str(db), "--session", "ada", "--shared"],
                stdin=b"hi\n\n", capture_stdout=True, capture_stderr=True,
            )  # fmt: skip
        assert [m.content for m in await registry.ref("served").history()] == ["kept", "kept"]
    error = refused.stderr.decode().strip()
    assert refused.returncode != 0
    assert "shared" in error
    assert "Traceback" not in error, error
    assert len(error.splitlines()) == 1, error
    assert "Hello Ada!" in shared.stdout.decode()
