"""Probes of the stores at their edges: credentials, odd URLs, odd files."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from urllib.parse import quote

import pytest
import trio

from processes import sessions
from sessionactors import StoreError
from sessionactors.stores import RedisStore

PASSWORD = "p@ss/w:rd#?%"


@pytest.mark.redis
async def test_a_percent_encoded_password_with_reserved_characters_connects(
    private_redis_server: Callable[..., AbstractContextManager[str]],
) -> None:
    """A URL's password is percent-encoded (RFC 3986 userinfo), so a password with
    '@', '/', ':', '#', '?' or '%' can be written; the store decodes it."""
    with private_redis_server(config=("--requirepass", PASSWORD)) as url:
        host = url.removeprefix("redis://")
        store = RedisStore(f"redis://:{quote(PASSWORD, safe='')}@{host}")
        try:
            with trio.fail_after(20):
                assert await store.list_sessions() == []
        finally:
            await store.aclose()


def test_an_at_sign_in_a_query_option_is_no_user_info() -> None:
    """Only the user info before the query may be refused for a reserved character:
    an option's value may hold an "@" (a client name, a certificate's path)."""
    RedisStore("redis://127.0.0.1:6379/0?client_name=ops@host")
    with pytest.raises(ValueError, match="percent-encode"):
        RedisStore("redis://:pass/word@127.0.0.1:6379/0")


@pytest.mark.redis
@pytest.mark.parametrize(
    "spell",
    [
        lambda host: f"redis://{host}?password=hunter2secret",
        lambda host: f"redis://default:hunter2secret@{host}",
        lambda host: f"redis://:hunter2/hunter2x@{host}",  # not encoded: refused, not printed
    ],
)
def test_the_command_line_never_prints_the_password(
    private_redis_server: Callable[..., AbstractContextManager[str]],
    spell: Callable[[str], str],
) -> None:
    """A wrong password (or a URL that cannot be parsed) gives one line on stderr
    that names the server but never the password, however the URL carries it."""
    with private_redis_server(config=("--requirepass", "right")) as url:
        store = spell(url.removeprefix("redis://"))
        for command in (["list"], ["show", "x"], ["delete", "x", "--yes"]):
            done = sessions(*command, "--store", store)
            # (a wrong password: the store refused, 1; a URL that cannot be parsed: a
            # usage error, 2)
            assert done.returncode == (2 if "hunter2/" in store else 1), done.stdout
            assert "hunter2" not in done.stderr, done.stderr
            assert "***" in done.stderr, done.stderr


def test_store_errors_never_carry_the_password() -> None:
    for url in (
        "redis://:hunter2/hunter2x@127.0.0.1:1/0",
        "redis://127.0.0.1:1/x?password=hunter2",
    ):
        with pytest.raises((ValueError, StoreError)) as raised:
            RedisStore(url)
        assert "hunter2" not in str(raised.value)


_FULL_DISK = """
import resource, signal, sys, trio
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG)
resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))
import sessionactors as sa

async def main():
    store = sa.SQLiteStore(sys.argv[1])
    try:
        await store.exists("x")
    except sa.StoreError as exc:
        print(f"StoreError: {exc}")
    finally:
        await store.aclose()

trio.run(main)
"""


def test_a_store_file_that_cannot_be_created_leaves_nothing_behind(tmp_path: Path) -> None:
    """Creating a new SQLite store that fails part way (the disk full while its tables
    are made: stood in for by a process whose files may not grow past 8 KB) raises
    StoreError and leaves no temporary file in the directory."""
    path = tmp_path / "s.db"
    done = subprocess.run(
        [sys.executable, "-c", _FULL_DISK, str(path)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("StoreError: "), done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == []
