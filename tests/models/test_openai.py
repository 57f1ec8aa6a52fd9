"""OpenAIChatModel against a fake OpenAI-compatible server on loopback."""

import contextlib
import datetime
import email.utils
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import pytest
import trio

from sessionactors import (
    FinishChunk,
    Message,
    Model,
    ModelChunk,
    ModelError,
    ModelRequest,
    Role,
    TextChunk,
    ToolCall,
    ToolCallChunk,
    ToolSpec,
    Usage,
    UsageChunk,
)
from sessionactors.models import OpenAIChatModel

from .fake_openai_server import (
    FakeOpenAI,
    Reply,
    delta,
    error_reply,
    finish,
    open_fake_openai,
    sse,
    text_reply,
)

# Real sockets: never the autojump clock here; every wait is bounded by real time.
WAIT = 10


@pytest.fixture
async def fake() -> AsyncIterator[FakeOpenAI]:
    async with open_fake_openai() as app:
        yield app


def make_model(fake: FakeOpenAI, **kwargs: Any) -> OpenAIChatModel:
    kwargs.setdefault("backoff", 0.001)
    kwargs.setdefault("max_backoff", 0.01)
    return OpenAIChatModel(fake.base_url, "test-model", **kwargs)


def make_request(
    *messages: Message, tools: Sequence[ToolSpec] = (), session_id: str = "s1"
) -> ModelRequest:
    if not messages:
        messages = (Message.create(Role.USER, "hello"),)
    return ModelRequest(session_id=session_id, messages=messages, tools=tuple(tools))


async def collect(
    model: OpenAIChatModel,
    request: ModelRequest | None = None,
    chunks: list[ModelChunk] | None = None,
) -> list[ModelChunk]:
    """The chunks of one stream; they are also appended to ``chunks`` as they arrive."""
    if chunks is None:
        chunks = []
    with trio.fail_after(WAIT):
        async with contextlib.aclosing(model.stream(request or make_request())) as stream:
            async for chunk in stream:
                chunks.append(chunk)
    return chunks


def tool_fragment(
    index: int, *, id: str | None = None, name: str | None = None, arguments: str = ""
) -> dict[str, Any]:
    function: dict[str, Any] = {"arguments": arguments}
    fragment: dict[str, Any] = {"index": index, "function": function}
    if id is not None:
        fragment["id"] = id
        fragment["type"] = "function"
    if name is not None:
        function["name"] = name
    return fragment


# -- streaming ---------------------------------------------------------------


async def test_streams_text_chunks_in_order(fake: FakeOpenAI) -> None:
    """Each streamed delta.content becomes one TextChunk, in order."""
    fake.push(text_reply("Hel", "lo", " world"))
    chunks = await collect(make_model(fake))
    assert chunks == [TextChunk("Hel"), TextChunk("lo"), TextChunk(" world")]
    assert [(r.method, r.path) for r in fake.requests] == [("POST", "/v1/chat/completions")]


async def test_streams_tool_call_fragments_as_they_arrive(fake: FakeOpenAI) -> None:
    """Interleaved fragments of two tool calls come out as ToolCallChunks exactly as streamed."""
    fragments = [
        tool_fragment(0, id="call_a", name="lookup_order"),
        tool_fragment(1, id="call_b", name="refund"),
        tool_fragment(0, arguments='{"order'),
        tool_fragment(1, arguments='{"order_id"'),
        tool_fragment(0, arguments='_id": "A1'),
        tool_fragment(1, arguments=': "A2"}'),
        tool_fragment(0, arguments='001"}'),
    ]
    fake.push(
        Reply(
            pieces=sse(
                delta(role="assistant", content=None),
                *(delta(tool_calls=[f]) for f in fragments),
                finish("tool_calls"),
            )
        )
    )
    chunks = await collect(make_model(fake))
    assert chunks == [
        ToolCallChunk(0, id="call_a", name="lookup_order"),
        ToolCallChunk(1, id="call_b", name="refund"),
        ToolCallChunk(0, arguments='{"order'),
        ToolCallChunk(1, arguments='{"order_id"'),
        ToolCallChunk(0, arguments='_id": "A1'),
        ToolCallChunk(1, arguments=': "A2"}'),
        ToolCallChunk(0, arguments='001"}'),
    ]
    joined = {
        i: "".join(c.arguments for c in chunks if isinstance(c, ToolCallChunk) and c.index == i)
        for i in (0, 1)
    }
    assert json.loads(joined[0]) == {"order_id": "A1001"}
    assert json.loads(joined[1]) == {"order_id": "A2"}


async def test_text_and_tool_calls_in_one_delta_both_come_out(fake: FakeOpenAI) -> None:
    """A delta carrying both content and tool_calls yields the text first, then the fragments."""
    fake.push(
        Reply(
            pieces=sse(
                delta(content="Let me check.", tool_calls=[tool_fragment(0, id="c", name="f")]),
                finish("tool_calls"),
            )
        )
    )
    assert await collect(make_model(fake)) == [
        TextChunk("Let me check."),
        ToolCallChunk(0, id="c", name="f"),
    ]


async def test_skips_retry_only_blocks_comments_and_empty_data(fake: FakeOpenAI) -> None:
    """Blocks with no data (retry-only, comments, empty data) are skipped."""
    fake.push(
        Reply(
            pieces=(
                b"retry: 1000\n\n",
                b": keep-alive\n\n",
                b"event: ping\ndata:\n\n",
                *sse(delta(content="ok"), finish(), {"choices": []}),
            )
        )
    )
    assert await collect(make_model(fake)) == [TextChunk("ok")]


async def test_stops_at_done_without_waiting_for_the_server_to_close(fake: FakeOpenAI) -> None:
    """The stream ends at data: [DONE] even when the server keeps the response open."""
    fake.push(Reply(pieces=(*sse(delta(content="hi")), *sse(delta(content="after"))), stall=True))
    assert await collect(make_model(fake)) == [TextChunk("hi")]
    with trio.fail_after(WAIT):
        await fake.disconnected.wait()


async def test_a_finish_reason_ends_a_stream_without_done(fake: FakeOpenAI) -> None:
    """A stream that closes after a finish_reason but without [DONE] is complete."""
    fake.push(Reply(pieces=sse(delta(content="hi"), finish(), done=False)))
    assert await collect(make_model(fake)) == [TextChunk("hi")]


@pytest.mark.parametrize("reason", ["length", "content_filter", "a_new_reason"])
async def test_an_answer_cut_short_ends_with_its_finish_reason(
    fake: FakeOpenAI, reason: str
) -> None:
    """A finish_reason other than the natural ends ("stop", "tool_calls") comes as a
    FinishChunk, for the turn to keep on the answer's message."""
    fake.push(Reply(pieces=sse(delta(content="hi"), finish(reason))))
    assert await collect(make_model(fake)) == [TextChunk("hi"), FinishChunk(reason)]
    fake.push(Reply(pieces=sse(delta(content="hi"), finish("tool_calls"))))
    assert await collect(make_model(fake)) == [TextChunk("hi")]


async def test_a_reply_cut_short_by_the_servers_limit_says_so(fake: FakeOpenAI) -> None:
    """Through a registry: the reply's message carries the server's finish_reason."""
    import sessionactors as sa

    fake.push(Reply(pieces=sse(delta(content="The first"), finish("length"))))
    agent = sa.Agent(model=make_model(fake))
    with trio.fail_after(WAIT):
        async with sa.open_registry(agents={"a": agent}) as registry:
            reply = await (await registry.spawn("s")).send("List ten things.")
    assert reply.message is not None
    assert (reply.message.content, reply.message.metadata) == (
        "The first",
        {"finish_reason": "length"},
    )


# -- the request ---------------------------------------------------------------


async def test_request_converts_messages_tools_and_headers(fake: FakeOpenAI) -> None:
    """Messages, tools, extra_body, headers and the api_key reach the server in OpenAI's format."""
    fake.push(text_reply("ok"))
    call = ToolCall(id="call_1", name="lookup_order", arguments='{"order_id": "A1001"}')
    messages = (
        Message.create(Role.SYSTEM, "You are helpful."),
        Message.create(Role.USER, "Where is A1001?"),
        Message.create(Role.ASSISTANT, "", tool_calls=(call,)),
        Message.create(Role.TOOL, "shipped", tool_call_id="call_1"),
        Message.create(Role.ASSISTANT, "It shipped.", tool_calls=(call,)),
        Message.create(Role.TOOL, "no such order", tool_call_id="call_1", is_error=True),
        Message.create(Role.ASSISTANT, "Done."),
    )
    schema = {"type": "object", "properties": {"order_id": {"type": "string"}}}
    tools = (ToolSpec(name="lookup_order", description="Look up an order.", parameters=schema),)
    model = make_model(
        fake,
        api_key="sk-test",
        extra_body={"temperature": 0.2, "stream": False, "model": "other"},
        headers={"X-Trace": "t1"},
    )
    await collect(model, make_request(*messages, tools=tools))

    [recorded] = fake.requests
    openai_call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "lookup_order", "arguments": '{"order_id": "A1001"}'},
    }
    assert recorded.body == {
        "temperature": 0.2,
        "model": "test-model",
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [
            {"role": "system", "content": "You are helpful."},
            {"role": "user", "content": "Where is A1001?"},
            {"role": "assistant", "content": None, "tool_calls": [openai_call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "shipped"},
            {"role": "assistant", "content": "It shipped.", "tool_calls": [openai_call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "no such order"},
            {"role": "assistant", "content": "Done."},
        ],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "lookup_order",
                    "description": "Look up an order.",
                    "parameters": schema,
                },
            }
        ],
    }
    assert recorded.headers["authorization"] == "Bearer sk-test"
    assert recorded.headers["x-trace"] == "t1"
    assert recorded.headers["content-type"] == "application/json"
    assert recorded.headers["accept"] == "text/event-stream"


def usage_chunk(prompt: Any, completion: Any) -> dict[str, Any]:
    """The last chunk a server sends when asked for usage: no choices, the counts."""
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "choices": [],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": 0,
        },
    }


async def test_reads_the_usage_from_the_last_chunk(fake: FakeOpenAI) -> None:
    """The usage the server sends after the answer becomes a UsageChunk; null usage is skipped."""
    fake.push(
        Reply(pieces=sse(delta(content="Hi"), {**finish(), "usage": None}, usage_chunk(12, 3)))
    )
    chunks = await collect(make_model(fake))
    assert chunks == [TextChunk("Hi"), UsageChunk(12, 3)]


async def test_a_turn_keeps_the_usage_the_server_reports(fake: FakeOpenAI) -> None:
    """Through a registry, the reported usage lands on the reply and is summed in state and listing."""
    import sessionactors as sa

    for prompt in (10, 20):
        fake.push(Reply(pieces=sse(delta(content="ok"), finish(), usage_chunk(prompt, 2))))
    agent = sa.Agent(model=make_model(fake))
    with trio.fail_after(WAIT):
        async with sa.open_registry(agents={"a": agent}) as registry:
            ref = await registry.spawn("s")
            first = await ref.send("one")
            await ref.send("two")
            state = await ref.state()
            [info] = await registry.sessions()
    assert first.message is not None
    assert first.message.usage == Usage(input_tokens=10, output_tokens=2)
    assert state.usage == info.usage == Usage(input_tokens=30, output_tokens=4)
    assert all(r.body["stream_options"] == {"include_usage": True} for r in fake.requests)


async def test_stream_options_in_extra_body_are_kept(fake: FakeOpenAI) -> None:
    """A server that refuses stream_options can be spared them through extra_body."""
    fake.push(text_reply("ok"))
    await collect(make_model(fake, extra_body={"stream_options": {"include_usage": False}}))
    [recorded] = fake.requests
    assert recorded.body["stream_options"] == {"include_usage": False}


@pytest.mark.parametrize(
    "usage", [[1, 2], {"prompt_tokens": "5"}, {"prompt_tokens": -1}, {"completion_tokens": 1.5}]
)
async def test_a_malformed_usage_is_a_malformed_stream(fake: FakeOpenAI, usage: Any) -> None:
    """Usage that is not an object of non-negative integer counts is a ModelError."""
    fake.push(Reply(pieces=sse(delta(content="Hi"), {"choices": [], "usage": usage})))
    with pytest.raises(ModelError, match="usage"):
        await collect(make_model(fake))


async def test_request_omits_tools_and_authorization_when_absent(fake: FakeOpenAI) -> None:
    """Without tools or an api_key, the body has no tools and no Authorization header is sent."""
    fake.push(text_reply("ok"))
    await collect(make_model(fake))
    [recorded] = fake.requests
    assert "tools" not in recorded.body
    assert "authorization" not in recorded.headers


async def test_a_tool_message_without_call_id_is_a_model_error(fake: FakeOpenAI) -> None:
    """A tool message with no tool_call_id is refused before any request is sent."""
    bad = Message.create(Role.TOOL, "result")
    with pytest.raises(ModelError, match="no tool_call_id") as info:
        await collect(make_model(fake), make_request(bad))
    assert info.value.session_id == "s1"
    assert fake.requests == []


# -- retries -------------------------------------------------------------------


async def test_retries_a_500_then_streams(fake: FakeOpenAI) -> None:
    """A 500 before the first chunk is retried and the next answer streams."""
    fake.push(error_reply(500, "boom"), text_reply("ok"))
    assert await collect(make_model(fake)) == [TextChunk("ok")]
    assert len(fake.requests) == 2


async def test_retry_after_replaces_the_backoff(fake: FakeOpenAI) -> None:
    """A 429 with Retry-After: 0 is retried at once, whatever the backoff."""
    fake.push(error_reply(429, "slow down", headers=(("retry-after", "0"),)), text_reply("ok"))
    model = make_model(fake, backoff=WAIT * 2, max_backoff=WAIT * 2)
    assert await collect(model) == [TextChunk("ok")]
    assert len(fake.requests) == 2


async def test_retry_after_is_capped_by_max_backoff(fake: FakeOpenAI) -> None:
    """A Retry-After longer than max_backoff waits only max_backoff."""
    fake.push(error_reply(429, "slow down", headers=(("retry-after", "3600"),)), text_reply("ok"))
    assert await collect(make_model(fake, max_backoff=0.01)) == [TextChunk("ok")]
    assert len(fake.requests) == 2


async def test_gives_up_after_max_retries(fake: FakeOpenAI) -> None:
    """After max_retries more failures the last status is raised as a ModelError."""
    fake.push(*(error_reply(503, "overloaded") for _ in range(3)), text_reply("late"))
    with pytest.raises(ModelError, match="gave up after 3 attempt") as info:
        await collect(make_model(fake, max_retries=2))
    assert info.value.status_code == 503
    assert "overloaded" in str(info.value)
    assert len(fake.requests) == 3


async def test_retries_a_connection_broken_before_the_first_chunk(fake: FakeOpenAI) -> None:
    """A response that breaks before any chunk is retried."""
    fake.push(Reply(pieces=(b": warming up\n\n",), fail_after_pieces=True), text_reply("ok"))
    assert await collect(make_model(fake)) == [TextChunk("ok")]
    assert len(fake.requests) == 2


async def test_a_connection_broken_after_a_chunk_is_raised(fake: FakeOpenAI) -> None:
    """A response that breaks after a chunk was yielded raises instead of retrying."""
    fake.push(
        Reply(pieces=sse(delta(content="Hel"), done=False), fail_after_pieces=True),
        text_reply("again"),
    )
    chunks: list[ModelChunk] = []
    with pytest.raises(ModelError, match="broke after part of the answer") as info:
        await collect(make_model(fake), chunks=chunks)
    assert chunks == [TextChunk("Hel")]
    assert isinstance(info.value.__cause__, httpx.TransportError)
    assert len(fake.requests) == 1


async def test_an_unreachable_server_is_retried_then_raised() -> None:
    """Connection errors are retried max_retries times, then raised naming the URL."""
    with trio.socket.socket() as sock:
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    model = OpenAIChatModel(
        f"http://127.0.0.1:{port}/v1", "m", max_retries=1, backoff=0.001, max_backoff=0.01
    )
    with pytest.raises(ModelError, match="after 2 attempt") as info:
        await collect(model)
    assert f"127.0.0.1:{port}" in str(info.value)
    assert isinstance(info.value.__cause__, httpx.ConnectError)


# -- errors that are not retried --------------------------------------------------


@pytest.mark.parametrize(
    ("status", "advice"),
    [
        (401, "check the api_key"),
        (403, "check the api_key"),
        (404, "check base_url"),
        (400, "check the messages"),
    ],
)
async def test_client_errors_are_raised_at_once(fake: FakeOpenAI, status: int, advice: str) -> None:
    """A 4xx other than 429 is sent once and raised with its status, message and advice."""
    fake.push(error_reply(status, "Incorrect API key provided: sk-te***"), text_reply("no"))
    with pytest.raises(ModelError) as info:
        await collect(make_model(fake))
    assert info.value.status_code == status
    assert info.value.session_id == "s1"
    assert "Incorrect API key provided" in str(info.value)
    assert advice in str(info.value)
    assert len(fake.requests) == 1


async def test_an_error_body_that_is_not_json_is_quoted(fake: FakeOpenAI) -> None:
    """The text of a non-JSON error body appears in the ModelError."""
    fake.push(Reply(status=400, headers=(("content-type", "text/plain"),), pieces=(b"bad input",)))
    with pytest.raises(ModelError, match="bad input") as info:
        await collect(make_model(fake))
    assert info.value.status_code == 400


async def test_non_json_data_is_a_malformed_stream(fake: FakeOpenAI) -> None:
    """A data line that is not JSON raises a ModelError and is not retried."""
    fake.push(Reply(pieces=(b"data: {not json\n\n",)), text_reply("no"))
    with pytest.raises(ModelError, match="malformed stream: an event's data is not JSON"):
        await collect(make_model(fake))
    assert len(fake.requests) == 1


async def test_a_chunk_without_choices_is_a_malformed_stream(fake: FakeOpenAI) -> None:
    """A chunk with no choices list raises a ModelError naming choices."""
    fake.push(Reply(pieces=sse({"id": "chatcmpl-1", "object": "chat.completion.chunk"})))
    with pytest.raises(ModelError, match="no 'choices' list"):
        await collect(make_model(fake))


async def test_a_tool_fragment_with_a_bad_index_is_a_malformed_stream(fake: FakeOpenAI) -> None:
    """A tool call fragment whose index is not an integer raises a ModelError."""
    fake.push(Reply(pieces=sse(delta(tool_calls=[{"index": "0", "function": {}}]))))
    with pytest.raises(ModelError, match="wrong type"):
        await collect(make_model(fake))


async def test_an_error_event_in_the_stream_is_raised(fake: FakeOpenAI) -> None:
    """An error object in the stream raises a ModelError carrying its message."""
    fake.push(Reply(pieces=sse({"error": {"message": "context length exceeded"}})))
    with pytest.raises(ModelError, match="context length exceeded"):
        await collect(make_model(fake))


async def test_a_response_that_is_not_an_event_stream_is_refused(fake: FakeOpenAI) -> None:
    """A 200 answer that is not text/event-stream raises a ModelError naming the content-type."""
    fake.push(Reply(headers=(("content-type", "text/html"),), pieces=(b"<html></html>",)))
    with pytest.raises(ModelError, match="content-type 'text/html'"):
        await collect(make_model(fake))
    assert len(fake.requests) == 1


async def test_a_stream_cut_short_is_raised(fake: FakeOpenAI) -> None:
    """A stream that closes with neither [DONE] nor a finish_reason raises a ModelError."""
    fake.push(Reply(pieces=sse(delta(content="Hel"), done=False)))
    with pytest.raises(ModelError, match="ended before"):
        await collect(make_model(fake))


# -- cancellation and clients --------------------------------------------------------


@pytest.mark.parametrize("inject_client", [False, True])
async def test_cancelling_the_consumer_closes_the_connection(
    fake: FakeOpenAI, inject_client: bool
) -> None:
    """When the consumer is cancelled mid-stream the server sees the client disconnect."""
    fake.push(Reply(pieces=sse(delta(content="Hel"), done=False), stall=True))
    async with httpx.AsyncClient() as client:
        model = make_model(fake, client=client if inject_client else None)
        chunks: list[ModelChunk] = []
        with trio.move_on_after(WAIT) as scope:
            async for chunk in model.stream(make_request()):
                chunks.append(chunk)
                await fake.stalled.wait()
                # Negative control: while the stream is open, no disconnect is seen.
                assert not fake.disconnected.is_set()
                scope.deadline = trio.current_time() + 0.05
        assert scope.cancelled_caught
        assert chunks == [TextChunk("Hel")]
        with trio.fail_after(WAIT):
            await fake.disconnected.wait()
        assert fake.disconnects == 1
        assert not client.is_closed


async def test_closing_the_stream_early_closes_the_connection(fake: FakeOpenAI) -> None:
    """Closing the generator after the first chunk makes the server see the disconnect."""
    fake.push(Reply(pieces=sse(delta(content="Hel"), done=False), stall=True))
    with trio.fail_after(WAIT):
        async with contextlib.aclosing(make_model(fake).stream(make_request())) as stream:
            async for chunk in stream:
                assert chunk == TextChunk("Hel")
                break
        await fake.disconnected.wait()


async def test_an_injected_client_is_used_and_left_open(fake: FakeOpenAI) -> None:
    """A client passed in carries every request and is not closed by the model."""
    fake.push(text_reply("one"), text_reply("two"))
    async with httpx.AsyncClient(headers={"X-Client": "shared"}) as client:
        model = make_model(fake, client=client)
        assert await collect(model) == [TextChunk("one")]
        assert await collect(model) == [TextChunk("two")]
        assert not client.is_closed
    assert [r.headers.get("x-client") for r in fake.requests] == ["shared", "shared"]


# -- construction --------------------------------------------------------------------


def test_model_satisfies_the_protocol_and_hides_the_key() -> None:
    """OpenAIChatModel is a Model and its repr does not show the api_key."""
    model = OpenAIChatModel("http://127.0.0.1:8000/v1", "llama3", api_key="sk-secret")
    assert isinstance(model, Model)
    assert "sk-secret" not in repr(model)
    assert model.url == "http://127.0.0.1:8000/v1/chat/completions"
    assert OpenAIChatModel("http://h/v1/", "m").url == "http://h/v1/chat/completions"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"base_url": "127.0.0.1:8000/v1"},
        {"max_retries": -1},
        {"backoff": -0.1},
        {"max_backoff": float("nan")},
    ],
)
def test_invalid_settings_are_refused(kwargs: dict[str, Any]) -> None:
    """A base_url without a scheme or a negative or NaN retry setting raises ValueError."""
    settings: dict[str, Any] = {"base_url": "http://127.0.0.1:8000/v1", "model": "m", **kwargs}
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        OpenAIChatModel(**settings)


PAST = email.utils.format_datetime(datetime.datetime(2000, 1, 1, tzinfo=datetime.UTC), True)


@pytest.mark.parametrize(
    "header",
    [("retry-after", "0.05"), ("retry-after-ms", "50"), ("retry-after", PAST)],
    ids=["seconds", "milliseconds", "a past date"],
)
async def test_retry_after_is_read_as_seconds_milliseconds_or_a_date(
    fake: FakeOpenAI, header: tuple[str, str]
) -> None:
    """A 429 whose Retry-After is seconds or an HTTP date, or whose Retry-After-Ms is
    milliseconds, is retried after that short wait instead of the long backoff."""
    fake.push(error_reply(429, "slow down", headers=(header,)), text_reply("ok"))
    model = make_model(fake, backoff=WAIT * 2, max_backoff=WAIT * 2)  # outlasts collect()
    assert await collect(model) == [TextChunk("ok")]
    assert len(fake.requests) == 2


async def test_a_retry_after_that_is_no_time_leaves_the_backoff(fake: FakeOpenAI) -> None:
    """A Retry-After that is neither seconds nor a date is ignored: the backoff applies."""
    fake.push(error_reply(429, "slow down", headers=(("retry-after", "soon"),)), text_reply("ok"))
    assert await collect(make_model(fake)) == [TextChunk("ok")]
    assert len(fake.requests) == 2


async def test_calls_streamed_at_one_index_with_different_ids_are_separate_calls(
    fake: FakeOpenAI,
) -> None:
    """Servers that stream every tool call at index 0 (a new id per call) get one call per
    id through a turn: each runs with its own arguments, instead of one merged call whose
    arguments are two JSON objects run together."""
    import sessionactors as sa

    looked_up: list[str] = []

    @sa.tool
    async def lookup(order_id: str) -> str:
        """Look an order up."""
        looked_up.append(order_id)
        return f"paid {order_id}"

    fragments = [
        tool_fragment(0, id="call_a", name="lookup"),
        tool_fragment(0, arguments='{"order_id": "A1"}'),
        tool_fragment(0, id="call_b", name="lookup"),
        tool_fragment(0, arguments='{"order_id": "A2"}'),
    ]
    fake.push(
        Reply(pieces=sse(*(delta(tool_calls=[f]) for f in fragments), finish("tool_calls"))),
        text_reply("Both paid."),
    )
    agent = sa.Agent(model=make_model(fake), tools=[lookup])
    with trio.fail_after(WAIT):
        async with sa.open_registry(agents={"a": agent}) as registry:
            ref = await registry.spawn("s")
            reply = await ref.send("Check A1 and A2")
            history = await ref.history()
    assert reply.text == "Both paid."
    assert sorted(looked_up) == ["A1", "A2"]
    calls = history[1].tool_calls
    assert [(c.id, c.name, json.loads(c.arguments)) for c in calls] == [
        ("call_a", "lookup", {"order_id": "A1"}),
        ("call_b", "lookup", {"order_id": "A2"}),
    ]
    assert [(m.tool_call_id, m.content) for m in history[2:4]] == [
        ("call_a", "paid A1"),
        ("call_b", "paid A2"),
    ]
    # what the server was sent next pairs each call with its own result
    sent = fake.requests[1].body["messages"]
    assert [m.get("tool_call_id") for m in sent if m["role"] == "tool"] == ["call_a", "call_b"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"model": None},
        {"model": ""},
        {"base_url": None},
        {"api_key": 5},
        {"extra_body": [("temperature", 0.2)]},
        {"headers": "X-Team: a"},
        {"headers": {"X-Team": 5}},
        {"client": "http://127.0.0.1:8000"},
        {"max_retries": True},
        {"backoff": "1"},
    ],
)
def test_settings_of_the_wrong_type_are_refused_when_made(kwargs: dict[str, Any]) -> None:
    """Settings of the wrong type (or an empty model name) are refused when the model is
    made, with an error naming the setting, instead of failing every turn with an error
    from deep inside the request (or a request the server refuses)."""
    settings: dict[str, Any] = {"base_url": "http://127.0.0.1:8000/v1", "model": "m", **kwargs}
    with pytest.raises((TypeError, ValueError), match=next(iter(kwargs))):
        OpenAIChatModel(**settings)


async def test_usage_sent_with_every_chunk_is_counted_once(fake: FakeOpenAI) -> None:
    """A server that sends the usage so far with every chunk (OpenRouter, vLLM's
    continuous usage stats: running totals) has the answer counted once, with its last
    totals, not the sum of every running total."""
    import sessionactors as sa

    pieces = [
        {**delta(content="Hel"), "usage": {"prompt_tokens": 10, "completion_tokens": 1}},
        {**delta(content="lo"), "usage": {"prompt_tokens": 10, "completion_tokens": 2}},
        {**finish(), "usage": {"prompt_tokens": 10, "completion_tokens": 3}},
    ]
    fake.push(Reply(pieces=sse(*pieces)))
    chunks = await collect(make_model(fake))
    assert chunks == [TextChunk("Hel"), TextChunk("lo"), UsageChunk(10, 3)]
    fake.push(Reply(pieces=sse(*pieces)))
    with trio.fail_after(WAIT):
        async with sa.open_registry(agents={"a": sa.Agent(model=make_model(fake))}) as registry:
            ref = await registry.spawn("s")
            reply = await ref.send("hi")
            state = await ref.state()
    assert reply.message is not None
    assert reply.message.usage == state.usage == Usage(input_tokens=10, output_tokens=3)


async def test_a_refusal_streamed_by_the_server_is_the_answers_text(fake: FakeOpenAI) -> None:
    """A refusal (OpenAI streams it in delta.refusal, content null) comes out as text, so
    the turn's reply says why the model refused instead of being empty."""
    fake.push(
        Reply(
            pieces=sse(
                delta(role="assistant", content=None, refusal=""),
                delta(content=None, refusal="I can't help "),
                delta(content=None, refusal="with that."),
                finish(),
            )
        )
    )
    chunks = await collect(make_model(fake))
    assert chunks == [TextChunk("I can't help "), TextChunk("with that.")]
