"""Fake models for tests and examples: EchoModel and ScriptedModel."""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Sequence

import attrs
import trio

from .._errors import SessionActorsError
from .._model import FinishChunk, ModelChunk, ModelRequest, TextChunk, ToolCallChunk, UsageChunk
from .._records import Role, ToolCall, Usage
from ._stores import Gate

__all__ = ["EchoModel", "ScriptExhaustedError", "Scripted", "ScriptedModel"]

_WORD = re.compile(r"\s*\S+")


def _words(text: str) -> list[str]:
    return _WORD.findall(text) or ([text] if text else [])


@attrs.define(eq=False)
class EchoModel:
    """Streams the last user message back, word by word (``delay`` seconds per word)."""

    delay: float = 0.0
    prefix: str = ""

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelChunk]:
        """Stream the last user message back, one word per chunk."""
        text = ""
        for message in reversed(request.messages):
            if message.role is Role.USER:
                text = message.content
                break
        for word in _words(self.prefix + text):
            if self.delay:
                await trio.sleep(self.delay)
            else:
                await trio.lowlevel.checkpoint()
            yield TextChunk(word)


@attrs.frozen(kw_only=True)
class Scripted:
    """One scripted model answer.

    - ``text``: the reply, streamed word by word unless ``chunks`` is given.
    - ``chunks``: the exact text chunks to stream.
    - ``tool_calls``: calls to make (each streamed as fragments: id and name,
      then the arguments in two halves).
    - ``delay``: seconds to sleep before each chunk.
    - ``wait``: a :class:`Gate` (or a ``trio.Event``) to wait on before streaming, to
      hold a turn open until ``gate.open()``; ``wait_after`` chunks are streamed
      first. A ``Gate`` opens from any thread or loop (an asyncio test, or a sync
      test of an app that runs in the ``TestClient``'s thread); a ``trio.Event``
      is set only from trio code of the registry's run.
    - ``usage``: tokens to report, as a ``UsageChunk`` after the other chunks.
    - ``finish_reason``: why the answer was cut short (``"length"``), as a
      ``FinishChunk`` last: the turn keeps it in the message's metadata.
    - ``error``: raised after the chunks (a model failure).
    """

    text: str = ""
    chunks: Sequence[str] | None = None
    tool_calls: Sequence[ToolCall] = ()
    delay: float = 0.0
    wait: Gate | trio.Event | None = None
    wait_after: int = 0
    error: BaseException | None = None
    usage: Usage | None = None
    finish_reason: str | None = None

    def text_chunks(self) -> list[str]:
        """The text chunks this answer streams."""
        return list(self.chunks) if self.chunks is not None else _words(self.text)


class ScriptExhaustedError(SessionActorsError, RuntimeError):
    """The ScriptedModel was asked for more answers than it was given."""


ScriptExhaustedError.__module__ = "sessionactors.testing"  # (as a traceback names it)


Step = str | Scripted | BaseException | Callable[[ModelRequest], "str | Scripted"]


def _to_steps(steps: Iterable[Step]) -> list[Step]:
    return list(steps)


@attrs.define(eq=False)
class ScriptedModel:
    """Plays scripted answers in order, one per model request.

    Each step is a ``str`` (streamed word by word), a :class:`Scripted`, an
    exception instance (raised: the model fails), or a function of the
    request returning one of those. ``repeat`` keeps playing the last step
    once the script is used up; otherwise a further request raises
    ScriptExhaustedError. Every request is recorded in ``requests``.
    """

    steps: list[Step] = attrs.field(converter=_to_steps, factory=list)
    repeat: bool = False
    requests: list[ModelRequest] = attrs.field(factory=list, init=False)
    _next: int = attrs.field(default=0, init=False)

    def add(self, *steps: Step) -> None:
        """Append more steps to the script."""
        self.steps.extend(steps)

    async def stream(self, request: ModelRequest) -> AsyncIterator[ModelChunk]:
        """Play the next scripted answer (recording the request)."""
        self.requests.append(request)
        if self._next < len(self.steps):
            step = self.steps[self._next]
            self._next += 1
        elif self.repeat and self.steps:
            step = self.steps[-1]
        else:
            raise ScriptExhaustedError(
                f"the script has {len(self.steps)} answers and all were played; "
                "add more with ScriptedModel.add(...)"
            )
        if callable(step) and not isinstance(step, BaseException):
            step = step(request)
        if isinstance(step, BaseException):
            await trio.lowlevel.checkpoint()
            raise step
        script = step if isinstance(step, Scripted) else Scripted(text=step)
        # closed with this stream, when a consumer stops reading it part-way
        async with contextlib.aclosing(_play(script)) as chunks:
            async for chunk in chunks:
                yield chunk


async def _play(script: Scripted) -> AsyncGenerator[ModelChunk, None]:
    chunks: list[ModelChunk] = [TextChunk(c) for c in script.text_chunks()]
    for index, call in enumerate(script.tool_calls):
        half = len(call.arguments) // 2
        chunks.append(ToolCallChunk(index, id=call.id, name=call.name))
        chunks.append(ToolCallChunk(index, arguments=call.arguments[:half]))
        chunks.append(ToolCallChunk(index, arguments=call.arguments[half:]))
    if script.usage is not None:
        chunks.append(UsageChunk(script.usage.input_tokens, script.usage.output_tokens))
    if script.finish_reason is not None:
        chunks.append(FinishChunk(script.finish_reason))
    await trio.lowlevel.checkpoint()
    for i, chunk in enumerate(chunks):
        if script.wait is not None and i == script.wait_after:
            await script.wait.wait()
        if script.delay:
            await trio.sleep(script.delay)
        yield chunk
    if script.wait is not None and script.wait_after >= len(chunks):
        await script.wait.wait()
    if script.error is not None:
        raise script.error
