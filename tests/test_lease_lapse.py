"""A lease lapse that stops many sessions at once is one incident in the log (one
WARNING a renewal round, with the count and the first names; each session at DEBUG),
and the turn it cuts tells its caller which turn that was (``FencedOutError.turn_id``,
also in the gateway's JSON error). Two registries share one SQLite file, as two
processes would."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest
import trio
import trio.testing

import sessionactors as sa
from otel_sdk import Otel
from sessionactors.http import create_app
from sessionactors.testing import EchoModel, FaultyStore, Scripted, ScriptedModel
from test_fencing_probes import StallingWorker
from web.servers import serve_trio

TTL = 0.3  # worker A's leases: they lapse quickly while its renewals fail


def agents(hold: trio.Event) -> dict[str, sa.Agent]:
    """ "echo", and "held", whose turns stream a word and wait for ``hold``."""
    held = ScriptedModel([Scripted(text="part of it", wait=hold, wait_after=1)], repeat=True)
    return {"echo": sa.Agent(model=EchoModel()), "held": sa.Agent(model=held)}


def lease_lines(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "sessionactors"
        and r.levelno == level
        and ("lease" in r.getMessage() or "renew" in r.getMessage())
    ]


async def test_many_leases_that_lapse_together_are_one_warning_and_the_cut_turn_is_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Twelve live sessions whose renewals fail until their leases lapse are stopped in
    one round, told in one WARNING with their count and the first ten names (each
    session at DEBUG), the renewals that failed before in one WARNING a round; the
    caller of the turn that the lapse cut gets FencedOutError naming that turn."""
    caplog.set_level(logging.DEBUG, logger="sessionactors")
    faulty = FaultyStore(sa.SQLiteStore(tmp_path / "shared.db"))
    names = [f"s{i:02}" for i in range(12)]
    async with sa.open_registry(
        store=faulty, agents=agents(trio.Event()), leases=True, worker_id="a", lease_ttl=TTL
    ) as a:
        with trio.fail_after(30):
            for name in names[1:]:
                await (await a.spawn(name, agent="echo")).send("hello")
            held = await a.spawn(names[0], agent="held")
            async with held.subscribe() as events:
                turn = await held.submit("wait for it")
                async for event in events:
                    if isinstance(event, sa.Delta):
                        break
            await trio.sleep(TTL)  # a round renews them all at once
            # the renewals fail from the start of a round on (its first call, of the
            # session that woke first, held until they do), so that every lease lapses
            # in the same round however slowly the machine runs the round
            gate = faulty.hold("renew", session_id=names[1])
            while not gate.waiting:
                await trio.sleep(0.01)
            caplog.clear()
            faulty.fail("renew", times=None)
            gate.open()
            with pytest.raises(sa.FencedOutError) as caught:
                await turn.reply()
            while a.live():
                await trio.sleep(TTL / 3)
            faulty.fail("renew", times=0)
    assert caught.value.turn_id == turn.id
    assert caught.value.session_id == names[0]
    [lapsed] = [line for line in lease_lines(caplog, logging.WARNING) if "lapsed" in line]
    assert "12 sessions" in lapsed, lapsed
    assert all(f"'{name}'" in lapsed for name in names[:10]), lapsed
    assert all(f"'{name}'" not in lapsed for name in names[10:]), lapsed
    assert "2 more" in lapsed, lapsed
    unrenewed = [line for line in lease_lines(caplog, logging.WARNING) if "could not renew" in line]
    assert unrenewed, caplog.text
    assert all("12 sessions" in line for line in unrenewed), unrenewed
    debug = [line for line in lease_lines(caplog, logging.DEBUG) if "lapsed" in line]
    assert sorted(debug) == sorted(d for d in debug if any(f"'{n}'" in d for n in names))
    assert len(debug) == 12, debug


async def test_a_write_cut_by_a_lapsed_lease_is_recorded_as_fenced_out(
    tmp_path: Path, otel: Otel
) -> None:
    """A turn's journal append under way as its session's lease lapses (the store did
    not answer the renewals) is cut, and its caller gets FencedOutError: the store
    write's metric records it as that, error.type FencedOutError, not as Cancelled."""
    faulty = FaultyStore(sa.SQLiteStore(tmp_path / "shared.db"))
    async with sa.open_registry(
        store=faulty,
        agents=agents(trio.Event()),
        leases=True,
        worker_id="a",
        lease_ttl=TTL,
        telemetry=otel.telemetry,
    ) as a:
        with trio.fail_after(30):
            ref = await a.spawn("s", agent="echo")
            gate = faulty.hold("append", session_id="s")
            turn = await ref.submit("hello")
            while gate.waiting < 1:
                await trio.sleep(0.01)
            faulty.fail("renew", times=None)
            with pytest.raises(sa.FencedOutError):
                await turn.reply()
            faulty.fail("renew", times=0)
            gate.open()
    appends = [
        p
        for p in otel.points("sessionactors.store.write.duration")
        if p.attributes["sessionactors.store.operation"] == "append"
    ]
    assert {p.attributes.get("error.type") for p in appends} == {"FencedOutError"}, appends
    assert sum(p.count for p in appends) == 1


async def test_a_turn_cut_by_a_lease_another_worker_took_names_it(tmp_path: Path) -> None:
    """A worker whose renewals stalled past its lease while a turn ran, and whose
    session another worker then took over, has that turn's write refused: its caller's
    FencedOutError names the turn."""
    path = tmp_path / "shared.db"
    store_a = StallingWorker(path)
    hold = trio.Event()
    async with sa.open_registry(
        store=store_a, agents=agents(hold), leases=True, worker_id="a", lease_ttl=TTL
    ) as a:
        with trio.fail_after(30):
            ref = await a.spawn("s", agent="held")
            turn = await ref.submit("wait for it")
            await trio.testing.wait_all_tasks_blocked()
            store_a.stalled = True  # frozen past its lease: it thinks it holds it
            await trio.sleep(2 * TTL)
            async with sa.open_registry(
                store=sa.SQLiteStore(path), agents=agents(trio.Event()), leases=True
            ) as b:
                await b.ref("s").state()  # takes it over
                hold.set()
                with pytest.raises(sa.FencedOutError) as caught:
                    await turn.reply()
    assert caught.value.turn_id == turn.id


async def test_the_gateway_tells_the_turn_a_lease_lapse_cut(tmp_path: Path) -> None:
    """A message whose turn a lease lapse cut is answered 503 FencedOutError whose JSON
    names the turn (``turn_id``), which the client asks about before sending again."""
    faulty = FaultyStore(sa.SQLiteStore(tmp_path / "shared.db"))
    async with sa.open_registry(
        store=faulty, agents=agents(trio.Event()), leases=True, worker_id="a", lease_ttl=TTL
    ) as registry:
        await registry.spawn("s", agent="held")
        app = create_app(registry)
        async with serve_trio(app) as url, httpx.AsyncClient(base_url=url) as client:
            with trio.fail_after(30):
                async with trio.open_nursery() as nursery:
                    answers: list[httpx.Response] = []

                    async def post() -> None:
                        answers.append(
                            await client.post("/sessions/s/messages", json={"text": "wait"})
                        )

                    nursery.start_soon(post)
                    while not registry.live():
                        await trio.sleep(0.01)
                    faulty.fail("renew", times=None)
                [r] = answers
                faulty.fail("renew", times=0)
                assert r.status_code == 503, r.text
                body = r.json()
                assert body["error"] == "FencedOutError", body
                outcome = await client.get(f"/sessions/s/turns/{body['turn_id']}")
                assert outcome.status_code == 200, outcome.text
                assert outcome.json()["status"] == "lost", outcome.text
