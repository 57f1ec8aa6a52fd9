"""Model-based: random edits, turns and process deaths keep what was acknowledged, atomically.

A plan is a list of operations on one session (turns, edits, metadata,
hibernations), each optionally with a process death some virtual seconds after
it starts. The first test keeps a model of the session (its messages, metadata
and summary), advanced by every operation that was answered. After a death, the
next process must find the session as the model had it before the operation
that died, or as it would be after it: an operation either happened or did
not, and nothing answered is lost. Writes to the store, model answers and tool
calls take virtual time, so deaths land inside them too.

The second test does the same for agents that act (tools, reviews of a payment
that must not run twice, failing turns and retries), against a reference run
of the same plan without deaths instead of a model.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, currently_in_test_context, event, given, settings
from hypothesis import strategies as st

import sessionactors as sa
from sessionactors.stores import MemoryStore, Store
from sessionactors.testing import EchoModel, FlawedStore, Scripted, ScriptedModel, crash

WORDS = st.sampled_from(["alpha", "beta", "gamma", "delta", "omega"])
OPERATION = st.one_of(
    st.tuples(st.just("send"), WORDS),
    st.tuples(st.just("add"), WORDS),
    st.tuples(st.just("truncate"), st.integers(0, 5)),
    st.tuples(st.just("rewind"), st.integers(0, 8)),
    st.tuples(st.just("replace"), st.lists(WORDS, max_size=3)),
    st.tuples(st.just("metadata"), st.sampled_from("abc"), st.none() | st.integers(0, 9)),
    st.tuples(st.just("summary"), WORDS),
    st.tuples(st.just("hibernate")),
)
#: each operation, and the virtual seconds after its start when the process dies (None: it lives)
PLAN = st.lists(
    st.tuples(OPERATION, st.none() | st.floats(0, 2.5, allow_nan=False)), min_size=1, max_size=12
)


class SlowStore:
    """A store whose writes take virtual time (a user's fake of a distant store)."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def _slowly(self, name: str, *args: Any, **kwargs: Any) -> Any:
        await trio.sleep(0.25)
        result = await getattr(self._store, name)(*args, **kwargs)
        await trio.sleep(0.25)
        return result

    async def create(self, *args: Any) -> Any:
        return await self._slowly("create", *args)

    async def append(self, *args: Any, **kwargs: Any) -> Any:
        return await self._slowly("append", *args, **kwargs)

    async def write_snapshot(self, *args: Any, **kwargs: Any) -> Any:
        return await self._slowly("write_snapshot", *args, **kwargs)


@attrs.frozen
class Model:
    """What the session holds, as the callers were told."""

    messages: tuple[tuple[str, str], ...] = ()
    metadata: tuple[tuple[str, Any], ...] = ()
    summary: str | None = None


def seen(state: sa.SessionState) -> Model:
    return Model(
        messages=tuple((m.role.value, m.content) for m in state.messages),
        metadata=tuple(sorted(state.metadata.items())),
        summary=state.summary,
    )


def after(model: Model, operation: tuple[Any, ...]) -> Model:
    """The model once ``operation`` happened."""
    kind, *args = operation
    messages = list(model.messages)
    if kind == "send":
        messages += [("user", args[0]), ("assistant", args[0])]
    elif kind == "add":
        messages.append(("assistant", args[0]))
    elif kind == "truncate":  # at least the last n, from the user message that began a turn
        cut = max(0, len(messages) - args[0]) if args[0] else len(messages)
        users = [i for i, (role, _) in enumerate(messages) if role == "user" and i <= cut]
        messages = messages[users[-1] if users and cut < len(messages) else cut :]
    elif kind == "rewind":
        if args[0] < len(messages):
            messages = messages[: args[0] + 1]
    elif kind == "replace":
        messages = [("user", text) for text in args[0]]
    elif kind == "metadata":
        metadata = dict(model.metadata)
        if args[1] is None:
            metadata.pop(args[0], None)
        else:
            metadata[args[0]] = args[1]
        return attrs.evolve(model, metadata=tuple(sorted(metadata.items())))
    elif kind == "summary":
        return attrs.evolve(model, summary=args[0])
    return attrs.evolve(model, messages=tuple(messages))


async def perform(ref: sa.SessionRef, operation: tuple[Any, ...]) -> None:
    kind, *args = operation
    if kind == "send":
        await ref.send(args[0])
    elif kind == "add":
        await ref.add_messages([sa.Message.create(sa.Role.ASSISTANT, args[0])])
    elif kind == "truncate":
        await ref.truncate(args[0])
    elif kind == "rewind":
        history = await ref.history()
        if args[0] < len(history):
            await ref.rewind(history[args[0]].id)
    elif kind == "replace":
        await ref.replace_history([sa.Message.create(sa.Role.USER, t) for t in args[0]])
    elif kind == "metadata":
        await ref.set_metadata({args[0]: args[1]})
    elif kind == "summary":
        await ref.set_summary(args[0])
    else:
        await ref.hibernate()


AGENTS = {"echo": sa.Agent(model=EchoModel(delay=0.5))}


Plan = list[tuple[tuple[Any, ...], float | None]]


def die_after(
    seconds: float, registry: sa.Registry, process: trio.CancelScope, nursery: trio.Nursery
) -> trio.CancelScope:
    """The process dies ``seconds`` from now (its registry crashes and its scope is
    cancelled), unless the scope returned is cancelled first."""
    timer = trio.CancelScope()

    async def die() -> None:
        with timer:
            await trio.sleep(seconds)
            crash(registry)
            process.cancel()

    nursery.start_soon(die)
    return timer


async def run_plan(
    plan: Plan, wrap: Callable[[Store], Store] = lambda disk: disk, **options: Any
) -> None:
    """Run ``plan``, each process over its own ``SlowStore(wrap(disk))`` of one disk."""
    disk = MemoryStore()
    model = Model()
    #: the states a death may fall back to: with durability="hibernate", any since the
    #: last hibernation; otherwise the last answered one
    kept = [model]
    async with sa.open_registry(store=SlowStore(wrap(disk)), agents=AGENTS, **options) as registry:
        await registry.spawn("s")
    steps = list(plan)
    while steps:
        died: list[Model] | None = None
        with trio.CancelScope() as process:
            async with (
                sa.open_registry(store=SlowStore(wrap(disk)), agents=AGENTS, **options) as registry,
                trio.open_nursery() as nursery,
            ):
                ref = registry.ref("s")
                assert seen(await ref.state()) == model, "the state a process starts from"
                while steps:
                    operation, death = steps.pop(0)
                    if death is not None:
                        timer = die_after(death, registry, process, nursery)
                        died = [*kept, after(model, operation)]
                    try:
                        await perform(ref, operation)
                    except sa.SessionStoppedError:
                        # the death closed the registry between the operation's calls
                        # (a rewind reads the history first): its next call is refused
                        if not process.cancel_called:
                            raise
                    if process.cancel_called:
                        break  # it died as the operation ended: as if during it
                    model = after(model, operation)
                    hibernated = operation[0] == "hibernate"
                    fallback = options.get("durability") == "hibernate" and not hibernated
                    kept = [*kept, model] if fallback else [model]
                    died = None
                    if death is not None:
                        timer.cancel()
                        break
        async with sa.open_registry(
            store=SlowStore(wrap(disk)), agents=AGENTS, **options
        ) as registry:
            found = seen(await registry.ref("s").state())
        if died is None:
            assert found == model, f"answered {model}, the next process found {found}"
        else:
            assert found in died, (
                f"a death during an operation left {found}; it may have left one of {died}"
            )
            if currently_in_test_context():
                event("a death: the operation kept" if found == died[-1] else "a death: not kept")
            model = found
            kept = [model]


def virtual_run(
    plan: Plan, wrap: Callable[[Store], Store] = lambda disk: disk, **options: Any
) -> None:
    clock = trio.testing.MockClock(autojump_threshold=0)
    trio.run(functools.partial(run_plan, plan, wrap, **options), clock=clock)


@pytest.mark.parametrize("snapshot_every", [1, 3, 1000])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=PLAN)
def test_every_operation_is_kept_whole_or_not_at_all(snapshot_every: int, plan: Plan) -> None:
    virtual_run(plan, snapshot_every=snapshot_every)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=PLAN)
def test_without_a_journal_a_death_falls_back_to_a_state_since_the_last_hibernation(
    plan: Plan,
) -> None:
    virtual_run(plan, durability="hibernate")


#: For each flaw of the test kit's FlawedStore, a plan that it breaks: a turn, then a
#: death at the start of the next operation.
FLAWED_PLANS: dict[str, Plan] = {
    "lose_appends": [(("send", "alpha"), None), (("hibernate",), 0.0)],
    "ack_appends_early": [(("send", "alpha"), None), (("hibernate",), 0.0)],
    "lose_snapshots": [(("send", "alpha"), None)],
    "reorder_journal": [(("send", "alpha"), None), (("send", "beta"), None), (("hibernate",), 0.0)],
}


@pytest.mark.parametrize("flaw", sorted(FLAWED_PLANS))
def test_the_property_catches_a_store_that_breaks_the_contract(flaw: str) -> None:
    """The negative control: over a FlawedStore, a plan fails the property."""
    virtual_run(FLAWED_PLANS[flaw])  # passes over a sound store
    with pytest.raises(
        AssertionError, match=r"the next process found|the state a process|a death during"
    ):
        virtual_run(FLAWED_PLANS[flaw], lambda disk: FlawedStore(flaw, disk))


# ---- agents that act: tools, reviews, failures and retries -----------------------------

ACTION = st.one_of(
    st.tuples(st.just("send"), WORDS),
    st.tuples(st.just("look"), WORDS),
    st.tuples(st.just("pay"), WORDS),
    st.tuples(st.just("boom")),
    st.tuples(st.just("retry")),
    st.tuples(st.just("review"), st.booleans()),
    st.tuples(st.just("truncate"), st.integers(0, 5)),
    st.tuples(st.just("metadata"), st.sampled_from("abc"), st.none() | st.integers(0, 9)),
    st.tuples(st.just("hibernate")),
)
ACTIONS = st.lists(
    st.tuples(ACTION, st.none() | st.floats(0, 2.5, allow_nan=False)), min_size=1, max_size=12
)


def answer(request: sa.ModelRequest) -> str | Scripted | BaseException:
    """The model: a function of the conversation, so that every run answers alike."""
    last = request.messages[-1]
    if last.role is sa.Role.TOOL:
        return Scripted(text=f"done {last.content}", delay=0.3)
    word = last.content.split()[-1]
    if last.content == "boom":  # it streams part of an answer, then fails
        return Scripted(text="half an answer", delay=0.3, error=RuntimeError("the model failed"))
    if last.content.split()[0] in ("look", "pay"):
        name = last.content.split()[0]
        call = sa.ToolCall(
            id=f"c{len(request.messages)}", name=name, arguments=f'{{"q": "{word}"}}'
        )
        return Scripted(tool_calls=[call], delay=0.3)
    return Scripted(text=word, delay=0.3)


def agents(paid: list[str], pay_idempotent: bool = False) -> dict[str, sa.Agent]:
    async def look(q: str) -> str:
        await trio.sleep(0.3)
        return f"seen {q}"

    async def pay(q: str) -> str:
        await trio.sleep(0.3)
        paid.append(q)
        return f"paid {q}"

    tools = [
        sa.Tool(name="look", fn=look, description="Look."),
        sa.Tool(
            name="pay", fn=pay, description="Pay.", requires_review=True, idempotent=pay_idempotent
        ),
    ]
    return {"act": sa.Agent(model=ScriptedModel([answer], repeat=True), tools=tools)}


#: What a non-idempotent call interrupted by a crash is answered with (documented):
#: it is not run again, and it may or may not have run.
UNSURE = "this call was interrupted by a crash after it started"


def projection(state: sa.SessionState) -> tuple[object, ...]:
    """What a session holds, without the ids and times that differ between runs.

    A ``pay`` result reads "paid" whether the call is known to have run or was
    interrupted by a death (then the model is told it may or may not have run):
    the two are the same step of the conversation.
    """
    messages = []
    for m in state.messages:
        content, is_error = m.content, m.is_error
        if content.startswith(("paid ", UNSURE, "done paid ", f"done {UNSURE}")):
            content, is_error = ("done paid" if content.startswith("done") else "paid"), False
        calls = tuple((c.id, c.name, c.arguments) for c in m.tool_calls)
        messages.append((m.role.value, content, calls, m.tool_call_id, m.interrupted, is_error))
    reviews = tuple((r.tool_call.name, r.tool_call.arguments) for r in state.reviews)
    return (
        tuple(messages),
        tuple(sorted(state.metadata.items())),
        reviews,
        state.open_turn is not None,
    )


async def act(ref: sa.SessionRef, action: tuple[Any, ...]) -> str:
    """Do ``action``; what it answered (``ok`` or the error's type)."""
    kind, *args = action
    try:
        if kind in ("send", "look", "pay"):
            await ref.send(args[0] if kind == "send" else f"{kind} {args[0]}")
        elif kind == "boom":
            await ref.send("boom")
        elif kind == "retry":
            await ref.retry()
        elif kind == "review":
            pending = await ref.pending_reviews()
            if not pending:
                return "no review"
            await ref.review(pending[0].id, approve=args[0])
        elif kind in ("truncate", "metadata", "hibernate"):
            await perform(ref, action)
    except sa.SessionActorsError as exc:
        return type(exc).__name__
    return "ok"


async def run_actions(
    plan: Plan,
    deaths: bool,
    wrap: Callable[[Store], Store] = lambda disk: disk,
    pay_idempotent: bool = False,
    **registry_options: Any,
) -> tuple[list[object], list[str], list[str]]:
    """Run ``plan``, dying where it says when ``deaths``: the states after each action
    (the spawned state first), the actions' answers, and what ``pay`` paid.

    An action that a death interrupted is done again in the next process, as its
    caller would, unless that process finds it done. Without deaths, the run is
    the reference: a run with deaths must pass through the same states. Each
    process sees the disk through ``wrap``.
    """
    disk = MemoryStore()
    paid: list[str] = []
    reference = deaths and await run_actions(
        plan, False, pay_idempotent=pay_idempotent, **registry_options
    )
    options = {"agents": agents(paid, pay_idempotent), **registry_options}
    async with sa.open_registry(store=SlowStore(wrap(disk)), **options) as registry:
        states = [projection(await (await registry.spawn("s", agent="act")).state())]
    answers: list[str] = []
    done = 0
    redo = False
    while done < len(plan):
        with trio.CancelScope() as process:
            async with (
                sa.open_registry(store=SlowStore(wrap(disk)), **options) as registry,
                trio.open_nursery() as nursery,
            ):
                ref = registry.ref("s")
                while done < len(plan):
                    action, death = plan[done]
                    dies = deaths and death is not None and not redo
                    if dies:
                        assert death is not None
                        timer = die_after(death, registry, process, nursery)
                    answer = await act(ref, action)
                    if process.cancel_called:
                        break  # it died as the action ended: as if during it
                    answers.append(answer)
                    states.append(projection(await ref.state()))
                    done, redo = done + 1, False
                    if reference:
                        assert (answers[-1], states[-1]) == (
                            reference[1][done - 1],
                            reference[0][done],
                        ), (
                            f"action {done - 1} {action} of {plan} went otherwise than without deaths"
                        )
                    if dies:
                        timer.cancel()
                        break
        if process.cancel_called:
            assert reference
            async with sa.open_registry(store=SlowStore(wrap(disk)), **options) as registry:
                await registry.ref("s").state()  # wakes it: an open turn resumes
                await trio.sleep(60)
                found = projection(await registry.ref("s").state())
            before, after = reference[0][done], reference[0][done + 1]
            assert found in (before, after), (
                f"a death during action {done} {plan[done]} of {plan} left the session as "
                f"{found}; before the action it was {before}, after it {after}"
            )
            if found == after:
                answers.append("died, done")
                states.append(found)
                done += 1
            else:
                redo = True
    if reference:
        twice = collections.Counter(paid) - collections.Counter(reference[2])
        assert not twice, f"with deaths pay paid {paid}, without {reference[2]}: {plan}"
    return states, answers, paid


@pytest.mark.parametrize("snapshot_every", [1, 1000])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=ACTIONS)
def test_actions_of_agents_that_act_are_kept_whole_or_not_at_all(
    snapshot_every: int, plan: Plan
) -> None:
    clock = trio.testing.MockClock(autojump_threshold=0)
    run = functools.partial(run_actions, plan, deaths=True, snapshot_every=snapshot_every)
    trio.run(run, clock=clock)


@pytest.mark.parametrize(
    ("plan", "flaw", "pay_idempotent", "caught"),
    [
        ([(("send", "alpha"), None), (("boom",), 0.0)], "lose_appends", False, "a death during"),
        ([(("pay", "alpha"), None), (("review", True), 1.0)], None, True, "pay paid"),
    ],
    ids=["store", "tool"],
)
def test_the_actions_property_catches_lost_writes_and_a_tool_run_twice(
    plan: Plan, flaw: str | None, pay_idempotent: bool, caught: str
) -> None:
    """The negative controls: a store that loses writes, and a payment marked idempotent
    (so the turn that resumes after a death runs it again), each fail a plan that passes
    as it should be."""

    def run(wrap: Callable[[Store], Store], pay_idempotent: bool) -> None:
        clock = trio.testing.MockClock(autojump_threshold=0)
        trio.run(functools.partial(run_actions, plan, True, wrap, pay_idempotent), clock=clock)

    run(lambda disk: disk, False)
    with pytest.raises(AssertionError, match=caught):
        run(lambda disk: FlawedStore(flaw, disk) if flaw else disk, pay_idempotent)
