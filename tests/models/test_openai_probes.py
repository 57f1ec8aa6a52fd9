"""OpenAIChatModel probed as providers and proxies behave, against real servers on loopback."""

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio

import sessionactors as sa
from sessionactors.models import OpenAIChatModel

from .fake_openai_server import FakeOpenAI, Reply, open_fake_openai, text_reply

# Real sockets: never the autojump clock here; every wait is bounded by real time.
WAIT = 10


@pytest.fixture
async def fake() -> AsyncIterator[FakeOpenAI]:
    async with open_fake_openai() as app:
        yield app


async def send_one(model: OpenAIChatModel, text: str = "hello") -> sa.Reply:
    """One turn of a fresh session on ``model``, bounded in time."""
    with trio.fail_after(WAIT):
        async with sa.open_registry(agents={"a": sa.Agent(model=model)}) as registry:
            ref = await registry.spawn("probe-1")
            return await ref.send(text)


async def failed_turn(model: OpenAIChatModel) -> sa.ModelError:
    """The ModelError that fails one turn on ``model``."""
    with pytest.raises(sa.TurnFailedError) as info:
        await send_one(model)
    cause = info.value.__cause__
    assert isinstance(cause, sa.ModelError)
    assert cause.session_id == "probe-1"
    return cause


# -- the URL and the credentials -------------------------------------------------


async def test_a_base_url_with_a_query_keeps_it_after_the_path(fake: FakeOpenAI) -> None:
    """A base_url with a query (Azure's ?api-version=...) posts to {path}/chat/completions
    with the query kept, not to a path hidden inside the query."""
    fake.push(text_reply("ok"))
    model = OpenAIChatModel(fake.base_url + "/?api-version=2024-02-01", "m")
    assert model.url == fake.base_url + "/chat/completions?api-version=2024-02-01"
    assert (await send_one(model)).text == "ok"
    assert [r.path for r in fake.requests] == ["/v1/chat/completions"]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"base_url": "http://127.0.0.1:8000/v1\n"}, "base_url"),
        ({"base_url": "http://"}, "base_url"),
        ({"base_url": "http://:8000/v1"}, "base_url"),
        ({"base_url": "http://127.0.0.1:99999/v1"}, "base_url"),
        ({"api_key": "sk-abc\n"}, "api_key"),
        ({"api_key": "sk-\u00e9t\u00e9"}, "api_key"),
        ({"api_key": ""}, "api_key"),
        ({"headers": {"X-Team": "a\r\nX-Evil: 1"}}, "headers"),
        ({"headers": {"X-T\u00e9am": "a"}}, "headers"),
        ({"headers": {"X Team": "a"}}, "headers"),
    ],
)
def test_settings_that_cannot_be_sent_are_refused_when_made(
    kwargs: dict[str, Any], field: str
) -> None:
    """A base_url httpx cannot parse, or an api_key or header an HTTP request cannot carry
    (a newline read from a file, a non-ASCII character), is refused with a ValueError naming
    the setting when the model is made, not as an obscure failure of every turn."""
    settings: dict[str, Any] = {"base_url": "http://127.0.0.1:8000/v1", "model": "m", **kwargs}
    with pytest.raises(ValueError, match=field):
        OpenAIChatModel(**settings)


# -- what the server said --------------------------------------------------------


async def test_a_json_error_answered_with_200_is_quoted(fake: FakeOpenAI) -> None:
    """A proxy that answers 200 with a JSON error body (not an event stream) fails the
    turn with a ModelError that quotes the provider's message."""
    body = {"error": {"message": "Rate limit reached for gpt-4o-mini", "code": 429}}
    fake.push(
        Reply(headers=(("content-type", "application/json"),), pieces=(json.dumps(body).encode(),))
    )
    error = await failed_turn(OpenAIChatModel(fake.base_url, "m", max_retries=0))
    assert "Rate limit reached for gpt-4o-mini" in str(error)
    assert "application/json" in str(error)


async def test_a_redirect_names_where_it_points(fake: FakeOpenAI) -> None:
    """A redirect (http to https, a moved API) is not followed with the key in it: the
    ModelError names the status and the Location, and says to fix base_url."""
    target = "https://api.example.com/v1/chat/completions"
    fake.push(Reply(status=308, headers=(("location", target),)))
    error = await failed_turn(OpenAIChatModel(fake.base_url, "m", max_retries=0))
    assert error.status_code == 308
    assert target in str(error)
    assert "base_url" in str(error)
    assert len(fake.requests) == 1
