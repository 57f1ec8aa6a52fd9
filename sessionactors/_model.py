"""The model seam: what the actor asks of a language model.

A model is anything with ``stream(request)`` returning an async iterator of
chunks. Text arrives as :class:`TextChunk`; tool calls as
:class:`ToolCallChunk` fragments, which share an ``index`` per call, as
OpenAI-compatible servers stream them; the tokens the model counted, if it
reports them, as :class:`UsageChunk`; why it stopped, if it cut its answer
short, as :class:`FinishChunk`.
"""

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, Final, Protocol, runtime_checkable

import attrs

from ._records import Message, maker

__all__ = [
    "FinishChunk",
    "Model",
    "ModelChunk",
    "ModelRequest",
    "TextChunk",
    "ToolCallChunk",
    "ToolSpec",
    "UsageChunk",
    "make_request",
]


@attrs.frozen(kw_only=True)
class ToolSpec:
    """What the model is told about one tool: its name, purpose and JSON schema."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = attrs.field(
        factory=lambda: {"type": "object", "properties": {}}, hash=False
    )


@attrs.frozen(kw_only=True)
class ModelRequest:
    """One request to the model: the messages (system prompt first) and the tools.

    ``messages`` is a read-only sequence; it stays valid after the turn.
    """

    session_id: str
    messages: Sequence[Message]
    tools: tuple[ToolSpec, ...] = ()


#: A fast constructor of requests, for the turn loop (see ``_records.maker``).
make_request: Final = maker(ModelRequest)


@attrs.frozen
class TextChunk:
    """A piece of the reply's text."""

    text: str


@attrs.frozen
class ToolCallChunk:
    """A fragment of one tool call; fragments of one call share ``index``.

    The first fragment of a call usually carries ``id`` and ``name``; the
    ``arguments`` of all fragments, joined, are the call's JSON arguments (a name
    split across the fragments before them is joined too; one repeated in every
    fragment is the name). A
    fragment with a ``name`` and an ``id`` other than the one its index has
    begins a new call once the call at that index is whole (named, its
    arguments complete JSON): some servers stream every call at index 0, each
    with its own id.
    """

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@attrs.frozen
class UsageChunk:
    """The tokens the model counted for this answer: ``input_tokens`` read (the
    prompt) and ``output_tokens`` written (the completion).

    Usually the last chunk (OpenAI sends it after the text when asked with
    ``stream_options.include_usage``); several in one answer add up. The turn keeps
    the sum on the answer's assistant message (``Message.usage``) and adds it to
    the session's ``usage``.
    """

    input_tokens: int = 0
    output_tokens: int = 0


@attrs.frozen
class FinishChunk:
    """Why the model stopped an answer short of its own end, as the provider says it:
    ``"length"`` (its limit of output tokens), ``"content_filter"`` (its filter), or
    another reason (printable, 1 to 100 characters).

    The turn keeps it on the answer's assistant message, as its
    ``metadata["finish_reason"]``, for a client to tell a reply that was cut off
    from a whole one (the turn itself finishes: what was streamed is the answer).
    Send none for an answer that ended of its own accord (OpenAI's ``"stop"``, or
    to call tools): such a message carries no metadata. If a model sends several,
    the last is kept.
    """

    reason: str


ModelChunk = TextChunk | ToolCallChunk | UsageChunk | FinishChunk


@runtime_checkable
class Model(Protocol):
    """A language model that streams its answer to a request (how to write one for a
    provider's API: the model-adapter how-to)."""

    def stream(self, request: ModelRequest) -> AsyncIterator[ModelChunk]:
        """Stream the answer to ``request`` as chunks."""
        ...
