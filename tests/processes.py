"""Helpers for tests that run the command line as a trio subprocess."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping

import pytest
import trio

import forked_cli


def sessions(
    *args: str, stdin: str | None = None, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m sessionactors sessions ARGS`` (``stdin`` its input), to its end,
    with ``env`` added to the environment (whose SESSIONACTORS_STORE, if the tests were
    given one, is left out: the tests name their stores), in a process forked from one
    that has imported the package (``forked_cli``)."""
    inherited = {key: value for key, value in os.environ.items() if key != "SESSIONACTORS_STORE"}
    return forked_cli.run(
        ["sessions", *args], stdin=stdin, env={**inherited, **(env or {})}, timeout=120
    )


async def reap(process: trio.Process) -> None:
    """Kill ``process`` if it still runs, wait for it, and close its pipes."""
    if process.returncode is None:
        process.kill()
    await process.wait()
    for pipe in (process.stdin, process.stdout, process.stderr):
        if pipe is not None:
            await pipe.aclose()


def unprivileged() -> list[str]:
    """The command prefix that runs a process as one that file permissions apply to:
    none for a user other than root; for root, ``setpriv`` without the capabilities that
    override them (skips the test if there is no ``setpriv``)."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: file permissions do not apply")
    caps = "-dac_override,-dac_read_search"
    return [setpriv, f"--bounding-set={caps}", f"--inh-caps={caps}", "--"]
