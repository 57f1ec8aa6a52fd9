"""Helpers for tests that run the command line as a trio subprocess."""

from __future__ import annotations

import trio


async def reap(process: trio.Process) -> None:
    """Kill ``process`` if it still runs, wait for it, and close its pipes."""
    if process.returncode is None:
        process.kill()
    await process.wait()
    for pipe in (process.stdin, process.stdout, process.stderr):
        if pipe is not None:
            await pipe.aclose()
