"""The edges survey: bad inputs, corrupt stores and faults, tried through the public API.

Every case runs on a real SQLite file. For each, the survey records what the
caller got (a typed error: a ``SessionActorsError``, ``TypeError`` or
``ValueError``; or an untyped one; or nothing) and then reopens the store in a
new registry and counts the acknowledged turns it no longer finds there (each
turn whose ``send`` returned must be in the history, in order, exactly once).
Corrupt stores are the exception: what a flipped bit destroys was not
acknowledged to anyone, so there the survey counts how each damaged file reads:
refused with a typed error, read with every session intact, read with changed
content (the store keeps no checksums of its own: SQLite's structure is checked,
a message's text is not), or failed untyped.

Usage::

    .venv/bin/python benchmarks/survey_edges.py [--flips N] [--out FILE]

Writes ``benchmarks/results/edges.md`` (and ``edges.json``) unless ``--out``
names another file. Exits non-zero when a case lost an acknowledged turn or
answered with an untyped error.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import random
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
import trio

import sessionactors as sa
from sessionactors.stores import SQLiteStore
from sessionactors.testing import EchoModel, FaultyStore

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
TYPED = (sa.SessionActorsError, TypeError, ValueError)
_NAIVE = datetime.datetime(2026, 1, 1)  # no timezone: refused


def _agents(model: Any = None) -> dict[str, sa.Agent]:
    return {"echo": sa.Agent(model=model or EchoModel())}


@attrs.define
class Case:
    group: str
    name: str
    outcome: str  # "typed error", "accepted", "untyped error: X", "no error"
    lost: int | None  # acknowledged turns missing after a restart (None: not counted)
    detail: str = ""


def _classify(error: BaseException | None, name: str | None) -> str:
    if error is None:
        return "no error"
    if isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    if isinstance(error, TYPED):
        if name is not None and name not in str(error) and repr(name) not in str(error):
            return f"typed error not naming {name!r}: {type(error).__name__}"
        return "typed error"
    return f"untyped error: {type(error).__name__}: {error}"


async def _lost(path: Path, acked: dict[str, list[str]]) -> int:
    """Acknowledged user messages missing from a fresh registry's view of ``path``."""
    missing = 0
    async with sa.open_registry(store=SQLiteStore(path), agents=_agents()) as registry:
        for name, texts in acked.items():
            users = [
                m.content for m in await registry.ref(name).history() if m.role is sa.Role.USER
            ]
            it = iter(users)
            missing += sum(1 for text in texts if text not in it)  # in order, once each
    return missing


# ---- bad input at every public entry point ----------------------------------------------

BAD_CALLS: dict[str, Callable[[sa.SessionRef], Awaitable[Any] | Any]] = {
    "send of an int": lambda ref: ref.send(5),
    "send of bytes": lambda ref: ref.send(b"hi"),
    "send of None": lambda ref: ref.send(None),
    "send over the length limit": lambda ref: ref.send("x" * (1 << 20 + 1)),
    "send with an int idempotency key": lambda ref: ref.send("hi", idempotency_key=5),
    "send with a bytes idempotency key": lambda ref: ref.send("hi", idempotency_key=b"k"),
    "submit with an empty idempotency key": lambda ref: ref.submit("hi", idempotency_key=""),
    "submit_nowait of a list": lambda ref: ref.submit_nowait(["hi"]),
    "set_summary of an int": lambda ref: ref.set_summary(123),
    "truncate to a float": lambda ref: ref.truncate(1.5),
    "truncate to True": lambda ref: ref.truncate(True),
    "truncate to a negative count": lambda ref: ref.truncate(-1),
    "rewind to an int": lambda ref: ref.rewind(7),
    "rewind to an unknown message": lambda ref: ref.rewind("no-such-message"),
    "review with a non-bool": lambda ref: ref.review("r", approve="yes"),
    "review of an unknown id": lambda ref: ref.review("no-such-review", approve=True),
    "subscribe after a str": lambda ref: ref.subscribe(after="5"),
    "subscribe after a negative seq": lambda ref: ref.subscribe(after=-2),
    "send of a lone surrogate": lambda ref: ref.send("broken \ud800 text"),
    "set_metadata of a list": lambda ref: ref.set_metadata([("a", 1)]),
    "set_metadata with an unstorable value": lambda ref: ref.set_metadata({"a": object()}),
    "add_messages of a dict": lambda ref: ref.add_messages({"role": "user"}),
    "add_messages of a str": lambda ref: ref.add_messages("hello"),
    "add_messages separating a tool call from its result": lambda ref: ref.add_messages(
        [
            sa.Message.create(
                sa.Role.ASSISTANT, "", tool_calls=(sa.ToolCall(id="c1", name="lookup"),)
            ),
            sa.Message.create(sa.Role.USER, "in between"),
        ]
    ),
    "replace_history with a naive datetime": lambda ref: ref.replace_history(
        [attrs.evolve(sa.Message.create(sa.Role.USER, "x"), created_at=_NAIVE)]
    ),
    "turn_outcome of an int": lambda ref: ref.turn_outcome(5),
    "turn_outcome of another session's id": lambda ref: ref.turn_outcome("turn_x_1_2"),
    "retry with nothing to retry": lambda ref: ref.retry(),
}


BAD_SPAWNS: dict[str, dict[str, Any]] = {
    "spawn with an int system_prompt": {"system_prompt": 123},
    "spawn with list metadata": {"metadata": [("a", 1)]},
    "spawn with unstorable metadata": {"metadata": {"a": object()}},
    "spawn with an unknown agent": {"agent": "nobody"},
}

BAD_NAMES: dict[str, Any] = {
    "spawn of an empty name": "",
    "spawn of an int name": 5,
    "spawn of a name with a NUL": "a\x00b",
    "spawn of a 10,000-character name": "n" * 10_000,
}

BAD_OPTIONS: dict[str, dict[str, Any]] = {
    "idle_timeout=nan": {"idle_timeout": math.nan},
    "idle_timeout=-1": {"idle_timeout": -1},
    "mailbox_size=1.5": {"mailbox_size": 1.5},
    "mailbox_size=0": {"mailbox_size": 0},
    "lease_ttl=inf": {"lease_ttl": math.inf},
    "lease_ttl=nan": {"lease_ttl": math.nan},
    "shutdown_grace=-1": {"shutdown_grace": -1},
    "max_restarts=-1": {"max_restarts": -1},
    "durability='sometimes'": {"durability": "sometimes"},
    "replay_events=-5": {"replay_events": -5},
    "subscriber_buffer=0": {"subscriber_buffer": 0},
    "leases='yes'": {"leases": "yes"},
    "worker_id=''": {"worker_id": ""},
}


async def _input_case(tmp: Path, name: str, call: Callable[[sa.SessionRef], Any]) -> Case:
    path = tmp / f"input-{abs(hash(name))}.db"
    acked: dict[str, list[str]] = {"edge-1": []}
    error: BaseException | None = None
    async with sa.open_registry(store=SQLiteStore(path), agents=_agents()) as registry:
        ref = await registry.spawn("edge-1", agent="echo")
        await ref.send("before")
        acked["edge-1"].append("before")
        try:
            result = call(ref)
            if hasattr(result, "__await__"):
                await result
            elif hasattr(result, "__aenter__"):
                async with result:
                    pass
        except BaseException as exc:  # the survey records whatever came out
            error = exc
        await ref.send("after")
        acked["edge-1"].append("after")
    return Case("bad input", name, _classify(error, "edge-1"), await _lost(path, acked))


async def _repaired_case(tmp: Path, label: str, chunks: list[Any]) -> Case:
    """Model text that is not valid Unicode is stored repaired (U+FFFD), by policy."""
    path = tmp / f"repaired-{abs(hash(label))}.db"

    class Yields:
        async def stream(self, request: Any) -> Any:
            for chunk in chunks:
                yield chunk

    error: BaseException | None = None
    async with sa.open_registry(
        store=SQLiteStore(path), agents={"m": sa.Agent(model=Yields())}
    ) as registry:
        ref = await registry.spawn("edge-r", agent="m")
        try:
            await ref.send("hi")
        except BaseException as exc:
            error = exc
    lost = await _lost(path, {"edge-r": [] if error else ["hi"]})
    outcome = "accepted, stored repaired" if error is None else _classify(error, "edge-r")
    async with sa.open_registry(store=SQLiteStore(path), agents=_agents()) as registry:
        reply = (await registry.ref("edge-r").history())[-1].content
    return Case("bad model output", label, outcome, lost, f"stored as {reply!r}")


async def _spawn_case(tmp: Path, label: str, name: Any, options: dict[str, Any]) -> Case:
    path = tmp / f"spawn-{abs(hash(label))}.db"
    error: BaseException | None = None
    async with sa.open_registry(store=SQLiteStore(path), agents=_agents()) as registry:
        ref = await registry.spawn("kept", agent="echo")
        await ref.send("before")
        try:
            await registry.spawn(name, **{"agent": "echo", **options})
        except BaseException as exc:
            error = exc
        listed = [info.session_id for info in await registry.sessions()]
    named = name if isinstance(name, str) and name and len(name) < 100 else None
    outcome = _classify(error, named)
    if listed != ["kept"]:
        outcome += f"; stored anyway: {listed}"
    return Case("bad input", label, outcome, await _lost(path, {"kept": ["before"]}))


async def _option_case(tmp: Path, label: str, options: dict[str, Any]) -> Case:
    error: BaseException | None = None
    try:
        async with sa.open_registry(
            store=SQLiteStore(tmp / "options.db"), agents=_agents(), **options
        ):
            pass
    except BaseException as exc:
        error = exc
    option = next(iter(options))
    outcome = _classify(error, None)
    if error is not None and option not in str(error):
        outcome += f" (does not name {option})"
    return Case("bad option", label, outcome, None)


async def _model_case(tmp: Path, label: str, chunk: Any) -> Case:
    path = tmp / f"model-{abs(hash(label))}.db"

    class Yields:
        async def stream(self, request: Any) -> Any:
            yield chunk

    model = Yields()
    error: BaseException | None = None
    async with sa.open_registry(
        store=SQLiteStore(path), agents={"m": sa.Agent(model=model)}
    ) as registry:
        ref = await registry.spawn("edge-m", agent="m")
        try:
            await ref.send("hi")
        except BaseException as exc:
            error = exc
    lost = await _lost(path, {"edge-m": []})
    return Case("bad model output", label, _classify(error, "edge-m"), lost)


# ---- corrupt stores -----------------------------------------------------------------


async def _populated(path: Path, sessions: int, turns: int) -> dict[str, list[str]]:
    history: dict[str, list[str]] = {}
    async with sa.open_registry(store=SQLiteStore(path), agents=_agents()) as registry:
        for i in range(sessions):
            ref = await registry.spawn(f"c{i}", agent="echo", metadata={"tenant": f"t{i % 3}"})
            for k in range(turns):
                await ref.send(f"c{i} turn {k}")
            history[f"c{i}"] = [m.content for m in await ref.history()]
    return history


async def _read_all(path: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    async with sa.open_registry(store=SQLiteStore(path), agents=_agents()) as registry:
        infos = await registry.sessions()
        for info in infos:
            out[info.session_id] = [
                m.content for m in await registry.ref(info.session_id).history()
            ]
    return out


async def _corrupt_case(path: Path, original: dict[str, list[str]]) -> str:
    """How one damaged file reads: 'typed error', 'intact', 'changed content' or untyped."""
    try:
        read = await _read_all(path)
    except BaseException as exc:
        outcome = _classify(exc, None)
        return "typed error" if outcome == "typed error" else outcome
    if read == original:
        return "read intact"
    return "read with changed content"


async def _corrupt_cases(tmp: Path, flips: int, seed: int) -> list[Case]:
    good = tmp / "good.db"
    original = await _populated(good, sessions=8, turns=5)
    size = good.stat().st_size
    rng = random.Random(seed)
    tallies: dict[str, int] = {}
    examples: dict[str, str] = {}
    for i in range(flips):
        bad = tmp / f"flip-{i}.db"
        data = bytearray(good.read_bytes())
        bit = rng.randrange(size * 8)
        data[bit // 8] ^= 1 << (bit % 8)
        bad.write_bytes(data)
        outcome = await _corrupt_case(bad, original)
        tallies[outcome] = tallies.get(outcome, 0) + 1
        examples.setdefault(outcome, f"bit {bit}")
        bad.unlink()
    cases = [
        Case(
            "corrupt store",
            f"one flipped bit ({flips} files): {outcome}",
            outcome,
            None,
            f"{count} of {flips}; e.g. {examples[outcome]}",
        )
        for outcome, count in sorted(tallies.items())
    ]
    for label, keep in [
        ("truncated to 0 bytes", 0),
        ("truncated to half", size // 2),
        ("truncated to 100 bytes", 100),
    ]:
        bad = tmp / "truncated.db"
        bad.write_bytes(good.read_bytes()[:keep])
        cases.append(Case("corrupt store", label, await _corrupt_case(bad, original), None))
    bad = tmp / "garbage.db"
    bad.write_bytes(random.Random(seed).randbytes(size))
    cases.append(Case("corrupt store", "random bytes", await _corrupt_case(bad, original), None))
    return cases


# ---- faults -------------------------------------------------------------------------


async def _fault_case(tmp: Path, label: str, operation: str, times: int) -> Case:
    """A store operation fails ``times`` times mid-traffic; acknowledged turns survive."""
    path = tmp / f"fault-{operation}-{times}.db"
    store = FaultyStore(SQLiteStore(path))
    acked: dict[str, list[str]] = {f"f{i}": [] for i in range(4)}
    outcomes: set[str] = set()
    async with sa.open_registry(store=store, agents=_agents()) as registry:
        refs = [await registry.spawn(name, agent="echo") for name in acked]
        store.fail(operation, times=times)
        for k in range(6):
            for name, ref in zip(acked, refs, strict=True):
                try:
                    await ref.send(f"{name} {k}")
                    acked[name].append(f"{name} {k}")
                except BaseException as exc:
                    outcomes.add(_classify(exc, name))
                if operation != "append":
                    try:
                        await ref.hibernate()
                    except BaseException as exc:
                        outcomes.add(_classify(exc, name))
    outcome = ", ".join(sorted(outcomes)) or "no error"
    detail = f"{store.injected} failures injected"
    return Case("store fault", label, outcome, await _lost(path, acked), detail)


async def _model_fault_case(tmp: Path) -> Case:
    path = tmp / "model-fault.db"

    class Boom:
        async def stream(self, request: Any) -> Any:
            raise RuntimeError("the model's server went away")
            yield  # pragma: no cover

    agents = {"echo": sa.Agent(model=EchoModel()), "boom": sa.Agent(model=Boom())}
    error: BaseException | None = None
    async with sa.open_registry(store=SQLiteStore(path), agents=agents) as registry:
        ok = await registry.spawn("ok", agent="echo")
        bad = await registry.spawn("bad", agent="boom")
        await ok.send("fine")
        try:
            await bad.send("hi")
        except BaseException as exc:
            error = exc
        await ok.send("still fine")
    return Case(
        "model fault",
        "a model that raises",
        _classify(error, "bad"),
        await _lost(path, {"ok": ["fine", "still fine"]}),
    )


async def survey(flips: int, seed: int) -> list[Case]:
    cases: list[Case] = []
    with tempfile.TemporaryDirectory(prefix="sessionactors-survey-") as name:
        tmp = Path(name)
        for label, call in BAD_CALLS.items():
            cases.append(await _input_case(tmp, label, call))
        for label, options in BAD_SPAWNS.items():
            cases.append(await _spawn_case(tmp, label, f"new-{len(cases)}", options))
        for label, bad_name in BAD_NAMES.items():
            cases.append(await _spawn_case(tmp, label, bad_name, {}))
        for label, options in BAD_OPTIONS.items():
            cases.append(await _option_case(tmp, label, options))
        cases.append(
            await _model_case(
                tmp, "a tool call chunk with an int name", sa.ToolCallChunk(index=0, name=123)
            )
        )
        cases.append(await _model_case(tmp, "a chunk of the wrong type", 42))
        cases.append(
            await _repaired_case(
                tmp, "text with a lone surrogate", [sa.TextChunk("bad \ud800 text")]
            )
        )
        cases.append(
            await _repaired_case(
                tmp,
                "a surrogate pair split across chunks",
                [sa.TextChunk("a \ud83d"), sa.TextChunk("\ude00 b")],
            )
        )
        cases.extend(await _corrupt_cases(tmp, flips, seed))
        for operation, times in [("append", 1), ("append", 3), ("write_snapshot", 2), ("load", 1)]:
            cases.append(await _fault_case(tmp, f"{operation} fails {times}x", operation, times))
        cases.append(await _model_fault_case(tmp))
        shutil.rmtree(tmp, ignore_errors=True)
    return cases


# ---- the report ---------------------------------------------------------------------


def markdown(cases: list[Case], flips: int) -> str:
    lines = [
        "# Edges survey",
        "",
        "Bad inputs, corrupt stores and faults tried through the public API on real SQLite files",
        f"(`benchmarks/survey_edges.py`, {flips} bit-flipped files). *Lost* counts the",
        "acknowledged turns a new registry no longer finds after the case (must be 0;",
        "`-` where not counted).",
        "",
        "| group | case | outcome | lost | detail |",
        "| --- | --- | --- | --- | --- |",
    ]
    for case in cases:
        lost = "-" if case.lost is None else str(case.lost)
        lines.append(f"| {case.group} | {case.name} | {case.outcome} | {lost} | {case.detail} |")
    groups: dict[str, list[Case]] = {}
    for case in cases:
        groups.setdefault(case.group, []).append(case)
    lines += [
        "",
        "| group | cases | typed error | handled by policy | undetected change | other"
        " | acknowledged turns lost |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for group, members in groups.items():
        tally = dict.fromkeys(("typed", "policy", "changed", "other"), 0)
        for case in members:
            tally[_kind(case)] += _weight(case)
        counted = [c.lost for c in members if c.lost is not None]
        lost = str(sum(counted)) if counted else "-"
        lines.append(
            f"| {group} | {sum(tally.values())} | {tally['typed']} | {tally['policy']}"
            f" | {tally['changed']} | {tally['other']} | {lost} |"
        )
    return "\n".join(lines) + "\n"


def _weight(case: Case) -> int:
    """Cases a row stands for (a bit-flip row tallies many files)."""
    return int(case.detail.split(" of ")[0]) if " of " in case.detail else 1


def _kind(case: Case) -> str:
    """typed (a typed error), policy (accepted by a documented policy, or read intact),
    changed (a corrupt file read with different content: no checksum caught it), other."""
    if case.outcome == "typed error":
        return "typed"
    if case.outcome in ("accepted, stored repaired", "read intact"):
        return "policy"
    if case.outcome == "read with changed content":
        return "changed"
    return "other"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flips", type=int, default=200, help="bit-flipped files to try")
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument("--out", type=Path, default=RESULTS / "edges.md")
    args = parser.parse_args()
    cases = trio.run(survey, args.flips, args.seed)
    text = markdown(cases, args.flips)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    args.out.with_suffix(".json").write_text(
        json.dumps([attrs.asdict(c) for c in cases], indent=1) + "\n"
    )
    print(text)
    bad = [c for c in cases if (c.lost or 0) > 0 or _kind(c) == "other"]
    for case in bad:
        print(f"NOT HANDLED: {case.group}: {case.name}: {case.outcome} (lost {case.lost})")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
