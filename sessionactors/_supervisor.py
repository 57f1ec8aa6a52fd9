"""Supervision: the life of one session's task, restarting its actor after crashes.

A turn's own failures (the agent or model raised) fail that turn only. A crash
of the actor itself (a bug, a store fault) fails the waiters with
SessionCrashedError and starts a fresh incarnation from the durable state,
within a restart intensity; past it the session is marked failed. Other
sessions never notice.
"""

from __future__ import annotations

import logging
from collections import deque

import trio

from ._actor import Actor, Host, Phase, cause_part, crashed_error, deleted_error
from ._errors import (
    FencedOutError,
    SessionActorsError,
    StoreConfigurationError,
    StoreError,
    StoreNotDurableError,
    stopped_error,
)

__all__ = ["session_task"]

log = logging.getLogger("sessionactors")


async def session_task(host: Host, actor: Actor) -> None:
    """The supervised life of one session: run, and restart after crashes."""
    config = host.config
    crashes: deque[float] | None = None  # made on the first crash
    while True:
        # Shielded: a cancellation from outside the registry (a deadline around its
        # block) does not cut a session short. The registry's shutdown hurries it
        # instead (as at the end of the grace), and cancels it here if it gives up.
        scope = actor.run_scope = trio.CancelScope(shield=True)
        if actor.phase is Phase.KILLED or host.given_up:  # before this task began
            scope.cancel()
        try:
            with scope:
                if crashes is not None:  # a restart lets the others run first
                    await trio.lowlevel.checkpoint()
                await actor.run()
            if scope.cancelled_caught:
                if actor.phase is Phase.KILLED:  # deleted, or its lease was lost
                    _end(actor, actor.kill_error or deleted_error(actor.session_id))
                else:  # the closing registry gave up waiting for it
                    _given_up(host, actor)
            return
        except FencedOutError as exc:
            # the store no longer shows this worker's lease: stop here, no restart (a
            # write refused after the renewals found the lease lost, and counted it, is
            # no second loss)
            if not isinstance(actor.kill_error, FencedOutError):
                if exc.lost_data:
                    log.error(
                        "session %r stopped here: its store lost or rolled back data "
                        "(what it acknowledged since may be gone): %s",
                        actor.session_id,
                        exc,
                    )
                else:
                    log.warning(
                        "session %r stopped here: the store no longer shows this worker's "
                        "lease of it (another worker took it over, or the store lost or "
                        "rolled back data): %s",
                        actor.session_id,
                        exc,
                    )
                host.stats.leases_lost += 1
            actor.lease = None  # (its fence stays: see Actor.fence)
            if actor.kill_error is None:  # (the table ends its subscriptions with it)
                actor.kill_error = exc
            _end(actor, exc)
            return
        except Exception as exc:
            if exc is actor.journal.lost:
                # a write found the session gone from the store, which held it: nothing
                # to restart from (no crash: the store lost it)
                log.error("%s", exc)  # (it names the session and says it stops)
                actor.lease = None  # (the store holds none of it either)
                if actor.kill_error is None:  # (the table ends its subscriptions with it)
                    actor.kill_error = exc
                _end(actor, exc)
                return
            host.stats.crashes += 1
            if actor.deleted:  # crashed while being deleted: nothing to restart
                _end(actor, deleted_error(actor.session_id))
                return
            now = trio.current_time()
            if crashes is None:
                crashes = deque()
            crashes.append(now)
            while crashes and now - crashes[0] > config.restart_window:
                crashes.popleft()
            failed = len(crashes) > config.max_restarts
            # a store can come back (a restart, a failover): one that failed the session
            # only rests it for a window; any other cause marks it failed for good
            retry_after = config.restart_window if _store_fault(exc) else None
            error = crashed_error(actor.session_id, exc, failed=failed, retry_after=retry_after)
            error.__cause__ = exc
            if actor.stopping:  # the stop did not happen: its caller hears why
                actor.stop_error = exc if isinstance(exc, SessionActorsError) else error
            # What its subscribers have not heard yet: the outcome whose commit raised (the
            # store may have kept it) and that the turns it takes with it are void, said
            # by the next incarnation once it has read what the store kept.
            prior = actor.after_crash  # (it crashed before it had read the store)
            due, mail = actor.due, actor.turn_mail
            if not failed and mail is not None:
                unsure = None
                if due is not None and mail.turn_id == due.turn_id:
                    # the write of its outcome raised: the store may have kept it
                    unsure = crashed_error(actor.session_id, exc, storing=due.turn_id)
                elif actor.unanswered == mail.turn_id:
                    # a write of its steps was not answered in time: it may have landed
                    unsure = crashed_error(actor.session_id, exc, storing=mail.turn_id, step=True)
                if unsure is not None:
                    unsure.__cause__ = exc
                    mail.pending.set_error(unsure)
            lost = actor.fail_waiters(error, crash=exc)
            if prior is not None:
                due = due or prior[0]
                lost = prior[1] + lost
            if failed:
                for event in lost:  # no next incarnation: the store is not read again
                    actor.emit(event)
                if retry_after is None:
                    log.error(
                        "session %r crashed %d times within %g s and is marked failed",
                        actor.session_id,
                        len(crashes),
                        config.restart_window,
                        exc_info=exc,
                    )
                else:  # (a store that comes back: not for good, and its error says all)
                    log.warning(
                        "session %r crashed %d times within %g s, its store failing (%s), "
                        "and is marked failed; tried again on a request in %g s",
                        actor.session_id,
                        len(crashes),
                        config.restart_window,
                        exc,
                        retry_after,
                    )
                actor.phase = Phase.LEFT
                host.mark_failed(actor, cause_part(exc), retry_after)
                return
            log.warning(
                "session %r crashed and restarts from its durable state",
                actor.session_id,
                exc_info=exc,
            )
            host.stats.restarts += 1
            fresh = Actor(host, actor.session_id, None)
            fresh.hub = actor.hub
            # (one that crashed before it had read the store leaves the wake's news to it)
            fresh.restarted = actor.restarted or actor.is_ready
            if due is not None or lost:
                fresh.after_crash = (due, lost)
            if config.durability != "turn":  # what was answered, not the request cut short
                journal = actor.journal
                fresh.journal.unsaved = journal.unsaved[: journal.settled]
                fresh.journal.base = journal.base
                fresh.journal.floor = journal.floor
            fresh.lease, fresh.fence, fresh.renewed = actor.lease, actor.fence, actor.renewed
            if host.closing:  # it takes nothing new: it only hibernates what it has
                fresh.close()
                if actor.phase is Phase.ABORTING:
                    fresh.abort()
            actor.phase = Phase.LEFT
            host.replace(actor, fresh)
            actor = fresh
        except BaseException:
            # Not an Exception (KeyboardInterrupt, say): it ends the registry at once (the
            # other sessions are shielded from the nursery's cancellation: the registry's
            # hurried shutdown ends them). This session is hibernated on its way out as
            # they are, within the same bounds, and its waiters hear so
            host.interrupted()
            try:
                await _hibernate_interrupted(host, actor)
            finally:  # (interrupted again: it ends where it is)
                if actor.phase is not Phase.LEFT:
                    _end(actor, stopped_error(actor.session_id, "closing"))
            raise


async def _hibernate_interrupted(host: Host, actor: Actor) -> None:
    """Hibernate a session that something not an Exception escaped (see
    ``Actor.hibernate_interrupted``), shielded like its run, which the registry's giving
    up cancels; nothing is written once the registry gave up (or crashed: the test kit's
    ``crash`` stands for a process's death, which writes nothing)."""
    if not host.given_up:
        scope = actor.run_scope = trio.CancelScope(shield=True)  # (cancelled on giving up)
        with scope:
            try:
                await actor.hibernate_interrupted()
            except Exception as exc:  # (fenced out, say) what ends the registry is the other
                log.warning(
                    "session %r was interrupted and could not hibernate: %s",
                    actor.session_id,
                    exc,
                    exc_info=exc,
                )
    if host.given_up and actor.phase is not Phase.LEFT:  # before it hibernated, or while
        _given_up(host, actor)


def _given_up(host: Host, actor: Actor) -> None:
    """The closing registry stopped waiting for the session (its store did not answer
    within the write bound, or the test kit's ``crash`` stood for the process's death):
    nobody is left to answer its waiters, so answer them now."""
    sid = actor.session_id
    if host.dead:  # (the test kit's crash: the store was not waited for, it may be fine)
        if actor.turn_mail is not None:
            mail = actor.turn_mail
            mail.pending.set_error(stopped_error(sid, "crashed", mail.turn_id))
        _end(actor, stopped_error(sid, "crashed"))
        return
    if actor.turn_mail is not None:  # its write may not have landed
        mail = actor.turn_mail
        mail.pending.set_error(stopped_error(sid, "unsaved", mail.turn_id))
    if actor.acknowledged_unsaved():
        # (without a journal) answered turns that no write holds: the registry reports
        # them on exit, as it does when its closing snapshot fails
        host.unwritten(
            sid,
            StoreError(
                f"the store did not answer within {host.config.write_bound:g} s",
                session_id=sid,
            ),
        )
    _end(actor, stopped_error(sid, "closing"))


def _end(actor: Actor, error: SessionActorsError) -> None:
    """The actor is gone for good (deleted, lease lost, cancelled): fail every waiter."""
    if actor.stopping:  # the stop did not happen either
        actor.stop_error = error
    actor.fail_waiters(error)
    actor.publish_after_crash(loaded=False)
    actor.leave_table()


def _store_fault(exc: BaseException) -> bool:
    """Whether ``exc`` is a store failure a later call may not meet (not a refusal of
    the store's configuration, which no retry fixes)."""
    return isinstance(exc, StoreError) and not isinstance(
        exc, StoreConfigurationError | StoreNotDurableError
    )
