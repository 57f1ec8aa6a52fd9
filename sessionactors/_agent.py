"""Agent (model + system prompt + tools + limits) and the turn loop.

The loop asks the model, streams its text as deltas, assembles tool-call
fragments into calls, runs the tools, and asks again, until the model answers
with text or ``max_steps`` is reached. It talks to the session only through a
:class:`TurnContext`, which the actor provides.
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import attrs
import trio

from ._codec import MAX_SEQ, MAX_TEXT_CHARS
from ._errors import MaxStepsError, ModelError
from ._history import Estimator, default_estimate
from ._model import (
    FinishChunk,
    Model,
    TextChunk,
    ToolCallChunk,
    ToolSpec,
    UsageChunk,
    make_request,
)
from ._records import (
    NO_METADATA,
    Message,
    Role,
    ToolCall,
    Usage,
    check_printable,
    check_unicode,
    make_message,
    make_tool_call,
    new_id,
    storable,
    utcnow,
)
from ._telemetry import TurnTrace
from ._tools import Tool

__all__ = ["Agent", "Compaction", "TurnContext", "run_turn"]


def _tools_converter(tools: Iterable[Any]) -> tuple[Any, ...]:
    if isinstance(tools, str | bytes | Tool) or not isinstance(tools, Iterable):
        raise TypeError(
            f"Agent tools must be a list of sa.Tool (make them with @sa.tool), "
            f"not {type(tools).__name__}"
        )
    out = tuple(tools)
    for i, t in enumerate(out):
        if not isinstance(t, Tool):
            kind = "a function" if callable(t) else type(t).__name__
            raise TypeError(
                f"Agent tools[{i}] is {kind} ({t!r:.60}), not an sa.Tool; decorate the "
                "function with @sa.tool, or wrap it: sa.Tool(name=..., fn=...)"
            )
    names = [t.name for t in out]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ValueError(f"agent has several tools named {sorted(dup)}; tool names must be unique")
    return out


DEFAULT_SUMMARY_INSTRUCTIONS = (
    "Summarize the conversation below for your own later use: keep names, facts, "
    "decisions, open questions and what the user wants. Be concise. If an earlier "
    "summary is given, fold it in."
)


@attrs.frozen(kw_only=True)
class Compaction:
    """Keep long conversations inside the model's context.

    Before a turn whose request is estimated above ``max_tokens``, the history
    except its last ``keep_last`` messages (the turn's new user message
    counts) is summarized by ``summarizer`` (default: the agent's model) and
    replaced by the summary, which the model then sees after the system
    prompt. What is kept begins with a user message, as every chat API wants
    the first message after the system prompt and summary to be: the kept
    messages start at the first user message among the last ``keep_last``
    (so at most ``keep_last`` are kept, and a tool call is summarized or kept
    with its results), or, if they hold none, at the last user message
    before them. ``estimate`` counts tokens (default: about four characters a
    token).

    A compaction is a checkpoint, as a history edit that removes messages is:
    the turn's first write is the session's snapshot, and the events before the
    compaction leave the store's journal and the replay buffers, so the
    summarized messages are replayed by nothing.
    """

    max_tokens: int = attrs.field()
    keep_last: int = attrs.field(default=20)
    summarizer: Model | None = attrs.field(default=None)
    estimate: Estimator = attrs.field(default=default_estimate)
    instructions: str = attrs.field(default=DEFAULT_SUMMARY_INSTRUCTIONS)

    @max_tokens.validator
    def _check_max_tokens(self, _: object, value: int) -> None:
        _check_count("Compaction max_tokens", value)
        if value < 1:
            raise ValueError(f"Compaction max_tokens must be at least 1, not {value}")

    @keep_last.validator
    def _check_keep_last(self, _: object, value: int) -> None:
        _check_count("Compaction keep_last", value)
        # 0 would summarize away the user's new message before the model reads it
        if value < 1:
            raise ValueError(
                f"Compaction keep_last must be at least 1 (the user's new message), not {value}"
            )

    @summarizer.validator
    def _check_summarizer(self, _: object, value: Model | None) -> None:
        if value is not None:
            _check_model("Compaction summarizer", value)

    @estimate.validator
    def _check_estimate(self, _: object, value: Estimator) -> None:
        if not callable(value):
            raise TypeError(
                "Compaction estimate must be a function of the messages that returns their "
                f"token count, not {type(value).__name__} ({value!r:.60})"
            )

    @instructions.validator
    def _check_instructions(self, _: object, value: str) -> None:
        if not isinstance(value, str):
            raise TypeError(
                f"Compaction instructions must be str (what the summarizer is asked), "
                f"not {type(value).__name__}"
            )


def _check_count(what: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{what} must be an int, not {type(value).__name__} ({value!r:.60})")


def _check_model(what: str, value: object) -> None:
    if not callable(getattr(value, "stream", None)):
        raise TypeError(
            f"{what} must have a stream(request) method, such as "
            "sessionactors.models.OpenAIChatModel(base_url=..., model='gpt-4o') or "
            f"sessionactors.testing.EchoModel(), not {type(value).__name__} ({value!r:.60})"
        )


@attrs.frozen
class Agent:
    """What runs a session's turns: a model, a system prompt, tools and limits.

    A frozen value: share one agent between many sessions. ``max_steps`` bounds the
    model requests of a turn (a turn still calling tools then fails with
    ``MaxStepsError``); ``turn_timeout`` (seconds, None for none) bounds its time, from
    its start to its outcome, not its wait in the mailbox nor on a review: a turn past
    it is cut as ``ref.cancel()`` cuts it (what it streamed kept, marked
    ``interrupted``) and fails with ``TurnTimeoutError`` as its cause.
    """

    model: Model = attrs.field()
    system_prompt: str = attrs.field(default="")
    tools: tuple[Any, ...] = attrs.field(default=(), converter=_tools_converter)
    max_steps: int = attrs.field(default=8)
    compaction: Compaction | None = attrs.field(default=None)
    turn_timeout: float | None = attrs.field(default=None, kw_only=True)
    # made once from ``tools``: what the model is told, and the tools by name
    _specs: tuple[ToolSpec, ...] = attrs.field(init=False, repr=False, eq=False, hash=False)
    _by_name: dict[str, Any] = attrs.field(init=False, repr=False, eq=False, hash=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "_specs", tuple([t.spec for t in self.tools]))
        object.__setattr__(self, "_by_name", {t.name: t for t in self.tools})

    @model.validator
    def _check_model(self, _: object, value: Model) -> None:
        _check_model("Agent model", value)

    @system_prompt.validator
    def _check_system_prompt(self, _: object, value: str) -> None:
        if not isinstance(value, str):
            raise TypeError(f"Agent system_prompt must be str, not {type(value).__name__}")

    @compaction.validator
    def _check_compaction(self, _: object, value: Compaction | None) -> None:
        if value is not None and not isinstance(value, Compaction):
            raise TypeError(
                "Agent compaction must be an sa.Compaction(max_tokens=..., keep_last=...) "
                f"or None, not {type(value).__name__}"
            )

    @turn_timeout.validator
    def _check_turn_timeout(self, _: object, value: float | None) -> None:
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(
                "Agent turn_timeout must be a number of seconds or None, not "
                f"{type(value).__name__} ({value!r:.60})"
            )
        if not math.isfinite(value) or value <= 0:
            raise ValueError(
                f"Agent turn_timeout must be a finite number of seconds above 0, not {value!r}"
            )

    @max_steps.validator
    def _check_max_steps(self, _: object, value: int) -> None:
        _check_count("Agent max_steps", value)
        if value < 1:
            raise ValueError(f"max_steps must be at least 1, not {value}")

    @property
    def tool_specs(self) -> tuple[ToolSpec, ...]:
        """What the model is told about the agent's tools."""
        return self._specs

    def find_tool(self, name: str) -> Any:
        """The tool called ``name``, or None."""
        return self._by_name.get(name)


class TurnContext(Protocol):
    """What the turn loop may do to its session (provided by the actor)."""

    session_id: str
    turn_id: str
    #: text streamed so far in the current model step (kept if the turn is cancelled)
    partial: list[str]
    #: the turn's instrumentation, if the registry has telemetry
    trace: TurnTrace | None

    def request_messages(self, agent: Agent | None = None) -> Sequence[Message]:
        """What the model is sent: the system messages, then the history."""
        ...

    def delta(self, text: str) -> None: ...
    def add_message(self, message: Message) -> None: ...
    def run_tool_calls(self, agent: Agent, calls: Sequence[ToolCall]) -> Awaitable[bool]:
        """Run the calls and add their results; False if the turn must pause (review)."""
        ...


@attrs.define
class _CallParts:
    id: str | None = None
    name: str | None = None
    arguments: list[str] = attrs.Factory(list)

    def starts_another(self, chunk: ToolCallChunk) -> bool:
        """Whether a named fragment at this call's index begins another call.

        It does once this call is whole (merged, the arguments would be two JSON
        objects run together), when it has another id (some servers stream every
        call at index 0, one id each; others change the id within one call, before
        it is whole), or, with no ids to tell, when both carry arguments (servers
        that stream one whole call a chunk, with no index and no id; a server that
        repeats the name in every fragment of one call sends none once it is whole).
        """
        if not self.whole():
            return False
        if chunk.id and self.id:
            return chunk.id != self.id
        return bool(chunk.arguments.strip() and "".join(self.arguments).strip())

    def whole(self) -> bool:
        """Whether the call is complete: named, its arguments none or whole JSON."""
        if not self.name:
            return False
        text = "".join(self.arguments)
        if not text.strip():
            return True
        try:
            json.loads(text)
        except (ValueError, RecursionError):
            return False
        return True


@attrs.define
class _Step:
    """What one model call has streamed besides text: tool-call fragments, usage, and
    why it stopped (its ``FinishChunk``, if any).

    ``parts`` holds each index's call being streamed; ``calls`` every call, with its
    index, in the order they began (an index can have several: see ``_take_chunk``).
    """

    parts: dict[int, _CallParts] = attrs.Factory(dict)
    calls: list[tuple[int, _CallParts]] = attrs.Factory(list)
    usage: Usage | None = None
    finish_reason: str | None = None

    def metadata(self) -> Mapping[str, Any]:
        """The metadata of the step's message: its finish reason, if it has one."""
        reason = self.finish_reason
        return NO_METADATA if reason is None else {"finish_reason": reason}


#: The most characters of a model's ``FinishChunk.reason``.
MAX_FINISH_REASON_CHARS = 100


def finish_reason_of(chunk: FinishChunk) -> str:
    """The reason of a FinishChunk, or TypeError/ValueError saying why no message can
    keep it."""
    reason = chunk.reason
    said = f"the model streamed a FinishChunk whose reason {reason!r:.120}"
    if reason.__class__ is not str:
        raise TypeError(f"{said} is not a str")
    if not reason:
        raise ValueError(f"{said} is empty; send no FinishChunk for an answer that ended whole")
    if len(reason) > MAX_FINISH_REASON_CHARS:
        raise ValueError(f"{said} is over {MAX_FINISH_REASON_CHARS} characters")
    check_printable(reason, said)
    check_unicode(reason, said)
    return reason


def assemble_calls(calls: list[tuple[int, _CallParts]]) -> tuple[ToolCall, ...]:
    """Turn fragments (grouped by call) into tool calls, in index order (calls of one
    index in the order they began)."""
    if not calls:
        return ()
    made = []
    seen: set[str] = set()
    ordered = calls if len(calls) == 1 else sorted(calls, key=lambda item: item[0])
    for index, p in ordered:
        if not p.name:
            raise ValueError(f"the model streamed a tool call (index {index}) without a name")
        call_id = storable(p.id) if p.id else ""
        if not call_id or call_id in seen:
            # results are matched to calls by id: a call whose id another call of the
            # step has (a model may repeat one) gets its own, or its result could be
            # taken for the other's and the call left without one
            call_id = new_id("call")
        seen.add(call_id)
        made.append(
            make_tool_call(
                id=call_id,
                name=storable(p.name),
                arguments=storable("".join(p.arguments)) or "{}",
            )
        )
    return tuple(made)


#: The most characters one model answer (its text and tool calls) may stream: what a
#: turn can store (as much as a message the user sends). A longer one fails its turn.
MAX_ANSWER_CHARS = MAX_TEXT_CHARS


def answer_too_long(session_id: str) -> ModelError:
    """The error of a model answer over :data:`MAX_ANSWER_CHARS`."""
    return ModelError(
        f"session {session_id!r}: the model's answer went over {MAX_ANSWER_CHARS:,} "
        "characters (its text and tool calls), more than a turn can store, so it was "
        "stopped; ask for a shorter answer (or check that the model is not repeating itself)",
        session_id=session_id,
        public=True,  # (the library's own words: no address, no provider's answer)
    )


def _take_chunk(chunk: object, ctx: TurnContext, step: _Step, size: int) -> int:
    """Take one chunk into the step; the answer's size (``size`` before it) with it,
    or ModelError if that goes over :data:`MAX_ANSWER_CHARS` (its text is not taken:
    what a failed turn keeps stays within the bound)."""
    if isinstance(chunk, TextChunk):
        text = chunk.text
        if text.__class__ is not str:
            raise TypeError(f"the model streamed a TextChunk whose text is {text!r}, not a str")
        if text:
            size += len(text)
            if size > MAX_ANSWER_CHARS:
                raise answer_too_long(ctx.session_id)
            ctx.partial.append(text)
            ctx.delta(storable(text))
        return size
    if isinstance(chunk, ToolCallChunk):
        index, call_id, name, arguments = chunk.index, chunk.id, chunk.name, chunk.arguments
        _check_call_chunk(index, call_id, name, arguments)
        parts = step.parts
        p = parts.get(index)
        if p is None or (name and p.starts_another(chunk)):
            p = parts[index] = _CallParts()
            step.calls.append((index, p))
        if call_id:
            p.id = call_id
        if name:
            # a name repeated in every fragment is the name; one split across the first
            # fragments, before the arguments, is joined (as the arguments are)
            p.name = p.name + name if p.name and name != p.name and not p.arguments else name
        if arguments:
            p.arguments.append(arguments)
        size += len(arguments) + len(call_id or "") + len(name or "")
        if size > MAX_ANSWER_CHARS:
            raise answer_too_long(ctx.session_id)
        return size
    if isinstance(chunk, UsageChunk):
        usage = usage_of(chunk)
        step.usage = usage if step.usage is None else step.usage + usage
        return size
    if isinstance(chunk, FinishChunk):
        step.finish_reason = finish_reason_of(chunk)
        return size
    raise TypeError(
        f"the model streamed {chunk!r}, not a TextChunk, ToolCallChunk, UsageChunk or FinishChunk"
    )


def usage_of(chunk: UsageChunk) -> Usage:
    """The counts of a UsageChunk, or TypeError if they are not counts."""
    for field in ("input_tokens", "output_tokens"):
        value = getattr(chunk, field)
        if value.__class__ is not int or not 0 <= value <= MAX_SEQ:
            raise TypeError(
                f"the model streamed a UsageChunk whose {field} is {value!r}, "
                "not a count (an int from 0)"
            )
    return Usage(input_tokens=chunk.input_tokens, output_tokens=chunk.output_tokens)


#: How long an abandoned model stream may take to close (see ``close_stream``).
STREAM_CLOSE_SECONDS = 10.0


async def close_stream(stream: object) -> None:
    """Close an abandoned model stream (an HTTP response) now, even in a cancelled
    turn, but for a bounded time: a stream whose close hangs is left to the garbage
    collector rather than holding its turn (and its session's shutdown) forever."""
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        with trio.move_on_after(STREAM_CLOSE_SECONDS, shield=True):
            await aclose()


def _not_a_stream(stream: object) -> TypeError:
    """The error of a model whose ``stream()`` returned ``stream``, no async iterator (a
    coroutine it returned is closed: it was never to be awaited)."""
    kind = type(stream).__name__
    if inspect.iscoroutine(stream):
        stream.close()
        kind = "coroutine (an async def without yield)"
    return TypeError(
        f"the model's stream() returned a {kind}, not an async iterator of chunks: write "
        "stream as an async generator, `async def stream(self, request):` that yields "
        "each chunk (or a method that returns an async iterator)"
    )


def _check_call_chunk(index: object, id_: object, name: object, arguments: object) -> None:
    """A fragment of a tool call (its fields) holds what a stored call can hold, or
    fails the turn."""
    if index.__class__ is not int and (isinstance(index, bool) or not isinstance(index, int)):
        raise TypeError(f"the model streamed a ToolCallChunk whose index is {index!r}")
    if id_ is not None and not isinstance(id_, str):
        raise TypeError(f"the model streamed a ToolCallChunk whose id is {id_!r}")
    if name is not None and not isinstance(name, str):
        raise TypeError(f"the model streamed a ToolCallChunk whose name is {name!r}")
    if not isinstance(arguments, str):
        raise TypeError(f"the model streamed a ToolCallChunk whose arguments are {arguments!r}")


async def run_turn(agent: Agent, ctx: TurnContext) -> Message | None:
    """Run one turn; the final assistant message, or None if it paused for a review.

    Messages with tool calls join the history through ``ctx.add_message``; the
    final one is returned, for the caller to record with the turn's outcome.
    """
    specs = agent._specs
    trace = ctx.trace
    model = agent.model
    for _step in range(agent.max_steps):
        request = make_request(
            session_id=ctx.session_id, messages=ctx.request_messages(agent), tools=specs
        )
        step: _Step | None = None  # made by the first chunk that is not text
        size = 0  # characters of text and tool calls streamed (see MAX_ANSWER_CHARS)
        partial = ctx.partial
        partial.clear()
        call = first = trace.model_call(model, request) if trace is not None else None
        try:
            stream = model.stream(request)
        except BaseException as exc:  # (a model may connect before it returns its stream)
            if call is not None:
                call.end(None, exc)
            raise
        try:
            async for chunk in stream:
                if first is not None:
                    first.first_chunk()
                    first = None
                if chunk.__class__ is TextChunk:  # the common chunk, inline
                    text = chunk.text
                    if text.__class__ is not str:
                        raise TypeError(
                            f"the model streamed a TextChunk whose text is {text!r}, not a str"
                        )
                    if text:
                        size += len(text)
                        if size > MAX_ANSWER_CHARS:
                            raise answer_too_long(ctx.session_id)
                        partial.append(text)
                        ctx.delta(storable(text))
                else:
                    if step is None:
                        step = _Step()
                    size = _take_chunk(chunk, ctx, step, size)
        except BaseException as exc:
            if call is not None:
                call.end(step.usage if step is not None else None, exc)
            if isinstance(exc, TypeError) and not hasattr(stream, "__aiter__"):
                raise _not_a_stream(stream) from None
            await close_stream(stream)
            raise
        usage = step.usage if step is not None else None
        if call is not None:
            if step is not None and step.finish_reason is not None:
                call.finished(step.finish_reason)
            call.end(usage, None)
        text = storable("".join(partial))
        partial.clear()
        if step is None or not step.calls:  # the reply: it joins with the outcome
            return make_message(
                id=new_id("msg"),
                role=Role.ASSISTANT,
                content=text,
                created_at=utcnow(),
                usage=usage,
                metadata=NO_METADATA if step is None else step.metadata(),
            )
        calls = assemble_calls(step.calls)
        metadata = step.metadata()
        # what the step streamed is not kept alive while its tools run (nor the model's
        # stream): fewer objects for the collector to visit meanwhile
        del request, stream, chunk, step
        ctx.add_message(
            make_message(
                id=new_id("msg"),
                role=Role.ASSISTANT,
                content=text,
                created_at=utcnow(),
                tool_calls=calls,
                usage=usage,
                metadata=metadata,
            )
        )
        if not await ctx.run_tool_calls(agent, calls):
            return None
        # Tools checkpoint as they run; between steps, only a pending cancel matters.
        await trio.lowlevel.checkpoint_if_cancelled()
    raise MaxStepsError(
        f"the model was still calling tools after max_steps={agent.max_steps} steps; "
        "raise Agent.max_steps or make the tools' results more decisive"
    )
