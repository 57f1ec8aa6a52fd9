"""The trio guest run on an asyncio loop, and the two ways across it.

One asyncio loop hosts at most one trio run (trio keeps its run in a
thread-local), so every registry opened on that loop shares one
:class:`Host`, started by the first and ended by the last (a reference
count). Trio's guest mode runs trio's scheduler as callbacks of the asyncio
loop, on the loop's own thread: no second thread, no locks, and asyncio
objects (futures, tasks) can be touched from trio code directly.

Asyncio code does not call trio code directly: it hands a function to the
trio run with :meth:`Host.call` (a request and its answer) or
:meth:`Host.start` (a trio task that keeps running, for subscriptions), both
through ``TrioToken.run_sync_soon``, trio's documented entry from outside
its run. Trio code waits on asyncio work with :func:`wait_asyncio`.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import types
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import attrs
import outcome
import trio

from .._errors import Advice, AdviceKind, SessionStoppedError, advised
from .._nesting import WITHIN, Fixed, Within, within

__all__ = [
    "Host",
    "acquire_host",
    "current_host",
    "ended_error",
    "release_host",
    "wait_asyncio",
    "wait_future_uncancelled",
]

T = TypeVar("T")

#: The host of each running loop (weak: a loop that is gone takes its entry with it).
_HOSTS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Host] = weakref.WeakKeyDictionary()


@attrs.define(eq=False)
class Host:
    """One trio guest run on one asyncio loop.

    Lifecycle (``state``), changed only by :func:`acquire_host` and
    :func:`release_host`: ``"starting"`` until the trio run's nursery exists,
    ``"running"`` while any registry uses it (``users`` > 0), ``"stopping"``
    once the last one left, until ``finished`` is done.
    """

    loop: asyncio.AbstractEventLoop
    state: str = "starting"
    users: int = 0
    started: asyncio.Future[None] = attrs.field(init=False)
    finished: asyncio.Future[None] = attrs.field(init=False)
    token: trio.lowlevel.TrioToken | None = None
    nursery: trio.Nursery | None = None
    #: The SIGINT handler the run installed (see ``_take_interrupts``), or None.
    interrupt: Any = None
    #: The asyncio tasks that run the registry's models, tools and stores.
    tasks: weakref.WeakSet[asyncio.Future[Any]] = attrs.field(factory=weakref.WeakSet)
    _stop: trio.Event = attrs.field(factory=trio.Event)

    def __attrs_post_init__(self) -> None:
        self.started = self.loop.create_future()
        self.finished = self.loop.create_future()

    def run_sync_soon(self, fn: Callable[[], object]) -> None:
        """Run ``fn()`` inside the trio run soon (from anywhere)."""
        assert self.token is not None
        self.token.run_sync_soon(fn)

    def cancel_soon(self, scope: trio.CancelScope) -> None:
        """Cancel ``scope`` inside the trio run soon; nothing if the run has ended."""
        with contextlib.suppress(trio.RunFinishedError):
            self.run_sync_soon(scope.cancel)

    async def _main(self) -> None:
        async with trio.open_nursery() as nursery:
            self.token = trio.lowlevel.current_trio_token()
            self.nursery = nursery
            _resolve(self.started, None)
            await self._stop.wait()
            nursery.cancel_scope.cancel()

    def _done(self, result: outcome.Outcome[None]) -> None:
        # The run has ended: the loop's next registry starts a new one. (Left in place
        # until the task that ended it resumed, it made acquire_host wait on a future
        # already done, which does not yield: the loop spun there forever.)
        if _HOSTS.get(self.loop) is self:
            del _HOSTS[self.loop]
        if self.interrupt is not None and signal.getsignal(signal.SIGINT) is self.interrupt:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        if isinstance(result, outcome.Error):
            _fail(self.started, result.error)
            _fail(self.finished, result.error)
        else:
            _resolve(self.started, None)
            _resolve(self.finished, None)

    async def call(
        self, fn: Callable[..., Awaitable[T]], *args: Any, session_id: str | None = None
    ) -> T:
        """Run ``await fn(*args)`` in the trio run and return its result to asyncio.

        Its exception is raised as itself. Cancelling the asyncio caller cancels
        the trio call (which, for a library call, abandons only the wait).
        ``session_id`` names the session the call is about (for the error of a call
        that the end of the trio run cuts off), None for a call about no one session.
        """
        self._check_running()
        # (an asyncio tool of a turn calls in the turns that its task's context holds)
        call: _Call[T] = _Call(self.loop.create_future(), session_id, within())
        self.run_sync_soon(lambda: self._spawn(call, fn, args))
        try:
            return await call.future
        except asyncio.CancelledError:
            call.abandon(self)
            raise

    def _spawn(
        self, call: _Call[T], fn: Callable[..., Awaitable[T]], args: tuple[Any, ...]
    ) -> None:
        if call.future.done():  # abandoned before it began
            return
        if self.nursery is None or self.state == "stopping":
            _fail(call.future, ended_error(call.session_id))
            return
        self.nursery.start_soon(call.run, fn, args)

    def start(self, fn: Callable[[trio.CancelScope], Awaitable[None]]) -> Task:
        """Start ``fn(scope)`` as a trio task; the returned :class:`Task` ends or cancels it.

        ``fn`` runs inside ``scope`` and must not raise: it reports to asyncio itself.
        """
        self._check_running()
        task = Task(self, self.loop.create_future())
        self.run_sync_soon(lambda: self._start(task, fn))
        return task

    def check_loop(self) -> None:
        """Refuse (RuntimeError) a call made outside the loop that hosts this trio run:
        from another thread, or another loop, it would run trio code off its thread or
        await a future of another loop, after the request was already handed over.
        A host whose run has ended refuses every call as closed, from whichever loop."""
        if self.state == "stopping":
            raise advised(  # as the trio registry's objects raise
                SessionStoppedError,
                "the registry this object belongs to is closed (its trio run has ended); ",
                Advice(kind=AdviceKind.AIO_BLOCK),
                Advice(kind=AdviceKind.AIO_LIFESPAN),
            )
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not self.loop:
            where = "another asyncio loop" if running is not None else "outside any loop"
            raise RuntimeError(
                "this sessionactors.aio object belongs to the asyncio loop that opened its "
                f"registry, and was called from {where}; nothing was sent. Call it on that "
                "loop (from another thread: asyncio.run_coroutine_threadsafe(coro, loop)), "
                "or open a registry on this loop"
            )

    def _check_running(self) -> None:
        self.check_loop()
        if self.state != "running":  # ("starting": no registry has opened on it yet)
            raise advised(
                SessionStoppedError,
                "the registry this object belongs to is not open; ",
                Advice(kind=AdviceKind.AIO_BLOCK),
            )

    def _start(self, task: Task, fn: Callable[[trio.CancelScope], Awaitable[None]]) -> None:
        if task.cancel_requested or self.nursery is None:
            _resolve(task.finished, None)
            return
        self.nursery.start_soon(task.run, fn)


@attrs.define(eq=False)
class _Call(Generic[T]):
    """One asyncio-to-trio call: its future, the session it is about (None: no one
    session), the turns its caller's code is part of (see ``sessionactors._nesting``),
    and its trio cancel scope once it runs."""

    future: asyncio.Future[T]
    session_id: str | None
    within: Within = ()
    scope: trio.CancelScope | None = None

    async def run(self, fn: Callable[..., Awaitable[T]], args: tuple[Any, ...]) -> None:
        if self.future.done():
            return
        if self.within:
            WITHIN.set([Fixed(self.within)])  # (its own task's context)
        with trio.CancelScope() as self.scope:
            try:
                result = await fn(*args)
            except trio.Cancelled:
                if not self.future.done():  # the host's run is ending under it
                    _fail(self.future, ended_error(self.session_id))
                raise
            except BaseException as exc:  # handed to the asyncio caller, as itself
                _fail(self.future, exc)
                return
            _resolve(self.future, result)

    def abandon(self, host: Host) -> None:
        scope = self.scope
        if scope is not None:
            host.cancel_soon(scope)


@attrs.define(eq=False)
class Task:
    """A trio task started from asyncio; ``finished`` is done when it has ended."""

    host: Host
    finished: asyncio.Future[None]
    scope: trio.CancelScope | None = None
    cancel_requested: bool = False

    async def run(self, fn: Callable[[trio.CancelScope], Awaitable[None]]) -> None:
        try:
            with trio.CancelScope() as self.scope:
                if self.cancel_requested:
                    self.scope.cancel()
                await fn(self.scope)
        finally:
            _resolve(self.finished, None)

    def cancel(self) -> None:
        """Cancel the trio task (from asyncio; it ends soon after)."""
        if self.cancel_requested:
            return
        self.cancel_requested = True
        scope = self.scope
        if scope is not None and not self.finished.done():
            self.host.cancel_soon(scope)

    async def aclose(self) -> None:
        """Cancel the trio task and wait until it has ended."""
        self.cancel()
        await wait_future_uncancelled(self.finished)


async def acquire_host() -> Host:
    """The running loop's host, started if there is none; release it when done."""
    loop = asyncio.get_running_loop()
    host = _HOSTS.get(loop)
    while host is not None and host.state == "stopping":
        await wait_future_uncancelled(host.finished)
        host = _HOSTS.get(loop)
    if host is None:
        host = Host(loop)
        host.interrupt = _take_interrupts(host)
        try:
            trio.lowlevel.start_guest_run(
                host._main,
                run_sync_soon_threadsafe=loop.call_soon_threadsafe,
                run_sync_soon_not_threadsafe=loop.call_soon,
                done_callback=host._done,
                host_uses_signal_set_wakeup_fd=True,
                strict_exception_groups=True,
            )
        except RuntimeError as exc:
            if host.interrupt is not None:
                signal.signal(signal.SIGINT, signal.default_int_handler)
            raise RuntimeError(
                "sessionactors.aio could not start trio on this asyncio loop's thread: "
                f"{exc}; a thread runs at most one trio run (from trio code, use "
                "sessionactors.open_registry directly)"
            ) from exc
        _HOSTS[loop] = host
    host.users += 1
    try:
        await wait_future_uncancelled(host.started)  # quick: a few loop iterations
    except BaseException:
        await release_host(host)
        raise
    if host.state == "starting":
        host.state = "running"
    return host


def _take_interrupts(host: Host) -> Any:
    """A SIGINT handler of the library's own, for a loop that leaves SIGINT to Python's
    (IPython's terminal, ``python -m asyncio``, a script that runs its loop itself; not
    ``asyncio.run``, which has one); None elsewhere.

    Without it trio's guest run installs its own, which hands every Ctrl-C to the trio
    run: the registry died under the user's code, which went on. This one raises
    KeyboardInterrupt where Python's would, in the code the loop runs, except inside a
    step of the trio run (which it would leave half done) or in a task that runs the
    registry's models, tools and stores (whose failure it would be): one that comes
    there is raised in the loop as soon as that step ends.
    """
    loop = host.loop
    if threading.current_thread() is not threading.main_thread():
        return None
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return None

    def interrupt(signum: int, frame: types.FrameType | None) -> None:
        if asyncio.current_task(loop) in host.tasks or _in_trio(frame):
            loop.call_soon_threadsafe(_raise_interrupt)
        else:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    return interrupt


def _in_trio(frame: types.FrameType | None) -> bool:
    """Whether ``frame`` runs inside a step of a trio run (a frame of trio's below it)."""
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith("trio."):
            return True
        frame = frame.f_back
    return False


def _raise_interrupt() -> None:
    raise KeyboardInterrupt


def current_host() -> Host | None:
    """The host whose trio run the calling trio code runs in; None outside any (in a
    plain ``trio.run``, or in asyncio code)."""
    try:
        loop = asyncio.get_running_loop()
        token = trio.lowlevel.current_trio_token()
    except RuntimeError:
        return None
    host = _HOSTS.get(loop)
    return host if host is not None and host.token is token else None


async def release_host(host: Host) -> None:
    """One user less; the last one ends the trio run and waits for it to end."""
    host.users -= 1
    if host.users > 0 or host.state == "stopping":
        return
    host.state = "stopping"
    if host.token is not None:
        host.run_sync_soon(host._stop.set)
    await wait_future_uncancelled(host.finished)  # (its end took it out of _HOSTS)


async def wait_future_uncancelled(future: asyncio.Future[T]) -> T:
    """Wait for ``future`` even if the waiting task is cancelled meanwhile; then
    raise that cancellation (cleanup that must finish, as under a trio shield)."""
    cancelled: asyncio.CancelledError | None = None
    while not future.done():
        try:
            await asyncio.shield(future)
        except asyncio.CancelledError as exc:
            if future.cancelled():
                raise
            cancelled = exc
    if cancelled is not None:
        raise cancelled
    return future.result()


async def wait_asyncio(host: Host, awaitable: Awaitable[T]) -> T:
    """From trio: run ``awaitable`` as an asyncio task and wait for its result.

    Cancelling the trio caller cancels the asyncio task and waits for it to end.
    A task that ends otherwise than cancelled (it raised, or finished its work after
    all) ends this call so, as a trio function that does so under a cancellation
    does: its outcome is recorded, and trio's cancellation comes at the next
    checkpoint.
    """
    task = asyncio.ensure_future(awaitable, loop=host.loop)
    host.tasks.add(task)  # (an interrupt in it is the loop's: see _take_interrupts)
    done = trio.Event()
    task.add_done_callback(lambda _: host.run_sync_soon(done.set))
    try:
        await done.wait()
    except trio.Cancelled:
        task.cancel()
        with trio.CancelScope(shield=True):
            await done.wait()
        if task.cancelled():
            raise
    return task_result(task)


def task_result(task: asyncio.Future[T]) -> T:
    """The task's result; an asyncio cancellation that did not come from trio becomes
    a SessionStoppedError (not mistaken for trio's own cancellation): the loop is going
    away (asyncio.run's end, a server's second Ctrl-C), and a turn it cut fails as one
    its registry's close cut off does (send the message again), not as a model's own
    failure. A task that nobody cancelled let out a CancelledError of its own (an inner
    task's that it awaited): that is raised as it is, the code's own failure."""
    if task.cancelled() and (not isinstance(task, asyncio.Task) or task.cancelling()):
        raise SessionStoppedError(
            "an asyncio task that sessionactors.aio ran for a model, tool or store was "
            "cancelled by someone else (the asyncio loop shutting down, say): send the "
            "message again once a registry is open"
        )
    return task.result()


def ended_error(session_id: str | None) -> SessionStoppedError:
    """What a call gets that was under way when its registry closed (the last registry
    of the loop, whose trio run ends with it), as the trio registry's refs raise:
    it names the session the call was about (``session_id``; None: no one session)."""
    what = f"a call on session {session_id!r}" if session_id is not None else "a call"
    return advised(
        SessionStoppedError,
        f"the registry closed while {what} was under way, and the trio run of "
        "sessionactors.aio ended under it (the call may or may not have taken effect); ",
        Advice(kind=AdviceKind.AIO_AGAIN),
        session_id=session_id,
    )


def _resolve(future: asyncio.Future[T], value: T) -> None:
    if not future.done():
        future.set_result(value)


def _fail(future: asyncio.Future[Any], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
