"""The chat page at / in headless Chromium (Debian's chromium driven by Playwright), against
``python -m sessionactors serve`` behind a proxy whose connections the test can drop."""

import asyncio
import base64
import concurrent.futures
import re
import signal
import sqlite3
import time
import uuid
import zlib
from pathlib import Path
from typing import Any

import httpx
import pytest

from .browser import needs_chromium
from .proxy import open_proxy
from .served import serve_command

#: How often the page sends a message again that got no answer, before it shows it failed.
SEND_RETRIES = 4

pytestmark = needs_chromium

# Records the text of every streaming bubble as it changes, to see the reply grow.
WATCH_STREAMING = """() => {
  window.partials = [];
  new MutationObserver(() => {
    for (const el of document.querySelectorAll('.message.streaming'))
      window.partials.push(el.textContent);
  }).observe(document.getElementById('messages'),
             {subtree: true, childList: true, characterData: true});
}"""


def open_page(browser: Any, url: str) -> tuple[Any, list[str]]:
    """A new page of ``browser`` at ``url``, and the list of the errors its scripts
    raise from then on."""
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(url)
    return page, errors


def test_the_chat_page_streams_resumes_reloads_and_reviews(browser: object, tmp_path: Path) -> None:
    """On the chat page a person opens a session, sends with Enter and sees the reply grow
    word by word; after a dropped connection the page resumes with Last-Event-ID and shows
    what happened meanwhile exactly once; a reload shows the history, and so does a session
    opened while the network is down, once it is back; a refund waits for the Approve
    button and then finishes."""
    from playwright.sync_api import Browser, expect

    assert isinstance(browser, Browser)
    store = f"sqlite:///{tmp_path / 'chat.db'}"
    with (
        serve_command(store, "--token", "page-token") as server,
        open_proxy(server.port) as proxy,
    ):
        page, errors = open_page(browser, f"http://127.0.0.1:{proxy.port}/#token=page-token")
        page.evaluate(WATCH_STREAMING)

        # open a session, type, Enter: the reply streams in word by word
        page.fill("#new-session", "web-1")
        page.press("#new-session", "Enter")
        expect(page.locator("#title")).to_have_text("web-1")
        page.fill("#text", "hello there from the browser")
        page.press("#text", "Enter")
        assistant = page.locator(".message.assistant")
        expect(assistant.last).to_have_text("hello there from the browser", timeout=10_000)
        partials = page.evaluate("window.partials")
        assert "hello there" in partials, partials  # seen before the reply was complete
        expect(page.locator("#status")).to_have_text("connected", timeout=10_000)
        expect(page.locator("#session-list button")).to_have_text(["web-1"])

        # the connection drops; a reply happens meanwhile; the page resumes and shows it once
        proxy.drop()
        expect(page.locator("#status")).to_have_text("reconnecting", timeout=10_000)
        headers = {"authorization": "Bearer page-token"}
        reply = httpx.post(
            f"{server.url}/sessions/web-1/messages",
            json={"text": "sent while you were away"},
            headers=headers,
            timeout=10,
        )
        assert reply.json()["text"] == "sent while you were away"
        proxy.restore()
        expect(page.locator("#status")).to_have_text("connected", timeout=15_000)
        expect(assistant.last).to_have_text("sent while you were away", timeout=10_000)
        texts = ["hello there from the browser", "sent while you were away"]
        expect(page.locator(".message")).to_have_text([texts[0], texts[0], texts[1], texts[1]])

        # a reload shows the history
        page.reload()
        expect(page.locator(".message")).to_have_text([texts[0], texts[0], texts[1], texts[1]])

        # a session opened while the server gives no answer is read again until it does
        # (the page stayed empty, "connecting", for good)
        proxy.drop()
        page.fill("#new-session", "web-1")
        page.press("#new-session", "Enter")
        expect(page.locator("#status")).to_have_text("reconnecting", timeout=10_000)
        proxy.restore()
        expect(page.locator("#status")).to_have_text("connected", timeout=15_000)
        expect(page.locator(".message")).to_have_text([texts[0], texts[0], texts[1], texts[1]])

        # a refund waits for a person; Approve lets it run and the reply arrives
        page.fill("#text", "refund A1")
        page.press("#text", "Enter")
        review = page.locator(".review")
        expect(review).to_contain_text('refund({"order_id": "A1"})', timeout=10_000)
        review.locator("button.approve").click()
        expect(assistant.last).to_have_text("Refunded: order A1 refunded", timeout=10_000)
        expect(review).to_have_count(0)
        expect(page.locator(".message.tool")).to_have_text(["order A1 refunded"])
        page.close()
        assert not errors


def test_the_chat_page_keeps_what_a_failed_turn_streamed(browser: object, tmp_path: Path) -> None:
    """On the chat page a reply whose model fails part-way stays as streamed, marked
    interrupted, with the error below it; after a reload the page shows that text again,
    marked interrupted."""
    from playwright.sync_api import Browser, expect

    assert isinstance(browser, Browser)
    store = f"sqlite:///{tmp_path / 'failed.db'}"
    with serve_command(store) as server:
        page, errors = open_page(browser, f"{server.url}/#session=web-f")
        expect(page.locator("#title")).to_have_text("web-f")
        page.fill("#text", "fail half an answer")
        page.press("#text", "Enter")
        error = page.locator(".message.error")
        expect(error).to_have_text(
            "the turn failed with ConnectionError; the server's log has the details",
            timeout=10_000,
        )
        kept = page.locator(".message.assistant.interrupted")
        expect(kept).to_have_text("half an answer")
        expect(page.locator(".message.streaming")).to_have_count(0)

        page.reload()
        expect(page.locator(".message")).to_have_text(["fail half an answer", "half an answer"])
        expect(kept).to_have_text("half an answer")
        page.close()
        assert not errors


def test_the_chat_page_marks_a_reply_the_model_cut_short(browser: object, tmp_path: Path) -> None:
    """A reply that the model cut short (its output limit) is marked so, with the reason,
    as it arrives and after a reload; a whole reply is not."""
    from playwright.sync_api import Browser, expect

    assert isinstance(browser, Browser)
    store = f"sqlite:///{tmp_path / 'cut.db'}"
    with serve_command(store) as server:
        page, errors = open_page(browser, f"{server.url}/#session=web-cut")
        expect(page.locator("#title")).to_have_text("web-cut")
        page.fill("#text", "cut the first words")
        page.press("#text", "Enter")
        cut = page.locator(".message.assistant.cut")
        expect(cut).to_have_text("the first words", timeout=10_000)
        expect(cut).to_have_attribute("data-finish", "length")
        page.fill("#text", "whole")
        page.press("#text", "Enter")
        expect(page.locator(".message.assistant")).to_have_count(2, timeout=10_000)

        page.reload()
        expect(page.locator(".message.assistant")).to_have_text(["the first words", "whole"])
        expect(cut).to_have_count(1)
        expect(cut).to_have_attribute("data-finish", "length")
        page.close()
        assert not errors


def test_the_chat_page_starts_a_session_on_a_server_of_several_agents(
    browser: object, tmp_path: Path
) -> None:
    """On a server of several agents, a new session's first message must name one: the
    page takes the agent with the session's name and sends it with the first message.
    Without one the server's refusal (422, it names the agents) stays shown: it was
    erased at once, with the message, as the page looked for the session anew; the
    message stays too, as not sent, until it is discarded."""
    from playwright.sync_api import Browser, expect

    assert isinstance(browser, Browser)
    store = f"sqlite:///{tmp_path / 'agents.db'}"
    with serve_command(store, "--agent", "chat_agents:two") as server:
        page, errors = open_page(browser, f"{server.url}/#session=web-none")
        expect(page.locator("#title")).to_have_text("web-none")
        page.fill("#text", "who answers")
        page.press("#text", "Enter")
        refused = page.locator(".message.error")
        expect(refused).to_contain_text("names no agent", timeout=10_000)
        page.wait_for_timeout(1_000)  # (the page looked for the session again within this)
        expect(refused).to_contain_text("names no agent")
        unsent = page.locator("#outbox .outgoing.failed")
        expect(unsent.locator(".state")).to_have_text("not sent: refused (422)")
        unsent.locator("button.discard").click()
        expect(page.locator("#outbox .outgoing")).to_have_count(0)

        page.fill("#new-session", "web-echo")
        page.fill("#new-agent", "echo")
        page.press("#new-session", "Enter")
        expect(page.locator("#title")).to_have_text("web-echo")
        page.fill("#text", "hello from the echo")
        page.press("#text", "Enter")
        expect(page.locator(".message.assistant")).to_have_text(
            ["hello from the echo"], timeout=10_000
        )
        state = httpx.get(f"{server.url}/sessions/web-echo", timeout=10).json()
        assert state["agent"] == "echo", state
        page.close()
        assert not errors


def test_the_chat_page_reaches_every_session(browser: object, tmp_path: Path) -> None:
    """The listing comes a page at a time: the page lists the first 100 sessions, newest
    first, and a "More sessions" button that lists the next page, until every session is
    listed (it listed the first 100 only); the list, refreshed as a turn ends, keeps
    what was listed."""
    from playwright.sync_api import Browser, expect

    assert isinstance(browser, Browser)
    store = f"sqlite:///{tmp_path / 'many.db'}"
    with serve_command(store, "--agent", "chat_agents:echo") as server:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            for i in range(105):
                r = client.post(f"/sessions/s{i:03d}/messages", json={"text": "hi"})
                assert r.status_code == 200, r.text
        page, errors = open_page(browser, f"{server.url}/")
        listed = page.locator("#session-list button")
        more = page.locator("#more-sessions")
        expect(listed).to_have_count(100, timeout=10_000)
        expect(listed.first).to_have_text("s104")
        more.click()
        expect(listed).to_have_count(105, timeout=10_000)
        expect(listed.last).to_have_text("s000")
        expect(more).to_be_hidden()

        # the oldest, opened and sent to, moves to the front; nothing listed is lost
        listed.last.click()
        expect(page.locator("#title")).to_have_text("s000")
        page.fill("#text", "back again")
        page.press("#text", "Enter")
        expect(page.locator(".message").last).to_have_text("back again", timeout=10_000)
        expect(listed.first).to_have_text("s000", timeout=10_000)
        expect(listed).to_have_count(105)
        expect(more).to_be_hidden()
        page.close()
        assert not errors


def test_a_session_whose_data_is_damaged_is_told_at_once(browser: object, tmp_path: Path) -> None:
    """A session the server cannot read (its stored snapshot garbled: a 500 every time)
    is told on the page at once, as failed, and other sessions still open (it was read
    again for good, "reconnecting", the error hidden)."""
    from playwright.sync_api import Browser, expect

    assert isinstance(browser, Browser)
    path = tmp_path / "damaged.db"
    with (
        serve_command(f"sqlite:///{path}", "--agent", "chat_agents:echo") as server,
        httpx.Client(base_url=server.url, timeout=30) as client,
    ):
        for name in ("bad", "good"):
            r = client.post(f"/sessions/{name}/messages", json={"text": f"hi {name}"})
            assert r.status_code == 200, r.text
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE snapshots SET data = ? WHERE session_id = 'bad'", (b"\xc1junk",))
    with serve_command(f"sqlite:///{path}", "--agent", "chat_agents:echo") as server:
        page, errors = open_page(browser, f"{server.url}/#session=bad")
        expect(page.locator("#status")).to_have_text("failed", timeout=10_000)
        expect(page.locator(".message.error")).to_have_count(1)
        page.locator("#session-list button", has_text="good").click()
        expect(page.locator(".message")).to_have_text(["hi good", "hi good"], timeout=10_000)
        expect(page.locator("#status")).to_have_text("connected", timeout=10_000)
        page.close()
        assert not errors


#: The JavaScript client asked to send a message again without an idempotency key.
SEND_AGAIN_WITHOUT_A_KEY = """async () => {
  const { SessionsClient } = await import("./sessionactors.js");
  try {
    await new SessionsClient().send("net", "no key", { retries: 1 });
    return "sent";
  } catch (error) {
    return `${error.name}: ${error.message}`;
  }
}"""


def test_the_chat_page_sends_each_message_once_whatever_the_network_does(
    browser: object, tmp_path: Path
) -> None:
    """Each message typed is sent with an idempotency key of its own, which its retries
    send again: a message whose request failed before any answer is sent again, and
    runs once both when it never reached the server (it was lost) and when the server
    ran it and only the answer was lost (a retry without the key would run it twice)."""
    from playwright.sync_api import Browser, expect

    assert isinstance(browser, Browser)
    store = f"sqlite:///{tmp_path / 'net.db'}"
    with serve_command(store) as server:
        page, errors = open_page(browser, f"{server.url}/#session=net")
        expect(page.locator("#status")).to_have_text("new", timeout=10_000)
        bodies: list[dict[str, Any]] = []
        faults: list[str] = []

        def network(route: Any) -> None:
            bodies.append(route.request.post_data_json)
            fault = faults.pop(0) if faults else None
            if fault == "unsent":  # the connection fails before the server has it
                route.abort("connectionreset")
            elif fault == "unanswered":  # the server runs it; its answer is lost
                route.fetch()
                route.abort("connectionreset")
            else:
                route.continue_()

        page.route("**/messages", network)
        shown = page.locator(".message")
        for fault, text in [("unsent", "first try"), ("unanswered", "second try")]:
            faults.append(fault)
            # (the first answer that comes is the retry's: the failed request got none)
            with page.expect_response("**/messages", timeout=15_000) as answered:
                page.fill("#text", text)
                page.press("#text", "Enter")
            assert answered.value.ok, answered.value.status
            assert answered.value.finished() is None  # (its stream, to its end)
        expect(shown).to_have_text(["first try"] * 2 + ["second try"] * 2, timeout=15_000)
        expect(page.locator("#status")).to_have_text("connected", timeout=10_000)

        state = httpx.get(f"{server.url}/sessions/net", timeout=10).json()
        assert [m["content"] for m in state["messages"]] == ["first try"] * 2 + ["second try"] * 2
        keys = [body["idempotency_key"] for body in bodies]
        assert len(keys) == 4, bodies
        assert keys[0] == keys[1], keys  # (a retry sends its message's key)
        assert keys[2] == keys[3], keys
        assert keys[0] != keys[2], keys  # (a message of its own: a key of its own)
        assert all(isinstance(key, str) and key for key in keys), keys
        # the client sends nothing again without a key (it might run twice)
        refused = page.evaluate(SEND_AGAIN_WITHOUT_A_KEY)
        assert refused.startswith("TypeError: retries need an idempotencyKey"), refused
        assert len(bodies) == 4, bodies
        page.close()
        assert not errors


def test_a_message_the_server_never_answers_fails_after_a_few_tries_and_can_be_sent_again(
    browser: object, tmp_path: Path
) -> None:
    """A message typed while the server is down shows as sending, is sent again a few
    times with its key, waiting longer each time, and then shows as not sent (it was
    sent again for ever); typed again while it is on its way, it is not sent a second
    time. Once the server is back, "Send again" sends it with the same key, and its
    turn runs once."""
    from playwright.sync_api import Browser, expect

    assert isinstance(browser, Browser)
    store = f"sqlite:///{tmp_path / 'down.db'}"
    with open_proxy(0) as proxy, serve_command(store) as server:
        proxy.target_port = server.port
        page, errors = open_page(browser, f"http://127.0.0.1:{proxy.port}/#session=down")
        keys: list[str] = []

        def sent(request: Any) -> None:
            if request.method == "POST" and request.url.endswith("/down/messages"):
                keys.append(request.post_data_json["idempotency_key"])

        page.on("request", sent)
        page.fill("#text", "before")
        page.press("#text", "Enter")
        shown = page.locator(".message")
        expect(shown).to_have_text(["before", "before"], timeout=10_000)
        expect(page.locator("#status")).to_have_text("connected", timeout=10_000)

        server.process.terminate()  # (serve_command checks that it stopped cleanly)
        server.process.wait(timeout=30)
        expect(page.locator("#status")).to_have_text("reconnecting", timeout=10_000)
        outgoing = page.locator("#outbox .outgoing")
        page.fill("#text", "while down")
        page.press("#text", "Enter")
        expect(outgoing).to_have_count(1)
        expect(outgoing).to_have_class(re.compile(r"\bsending\b"))
        expect(outgoing.locator(".state")).to_have_text("sending…")
        expect(outgoing.locator("button")).to_have_count(2)
        expect(outgoing.locator("button.resend")).to_be_hidden()
        page.fill("#text", "while down")  # typed again while it is on its way
        page.press("#text", "Enter")
        expect(outgoing).to_have_class(re.compile(r"\bfailed\b"), timeout=20_000)
        expect(outgoing.locator(".state")).to_contain_text("not sent")
        expect(outgoing.locator(".text")).to_have_text("while down")
        expect(outgoing).to_have_count(1)
        assert len(keys) == 1 + 1 + SEND_RETRIES, keys  # ("before", then its tries)
        assert len(set(keys[1:])) == 1, keys  # (one message, one key)
        assert keys[0] != keys[1], keys
        expect(shown).to_have_text(["before", "before"])

        with serve_command(store) as again:
            proxy.target_port = again.port
            outgoing.locator("button.resend").click()
            expect(shown).to_have_text(
                ["before", "before", "while down", "while down"], timeout=15_000
            )
            expect(outgoing).to_have_count(0)
            assert len(keys) == 1 + 1 + SEND_RETRIES + 1, keys
            assert keys[-1] == keys[1], keys  # (sent again with its key)
            state = httpx.get(f"{again.url}/sessions/down", timeout=10).json()
            assert [m["content"] for m in state["messages"]] == [
                "before",
                "before",
                "while down",
                "while down",
            ]
            page.close()
        assert not errors


# Holds the answers to GET /sessions/{name} (not its events or messages) for 1.5 s, as a
# slow network would: the state read when it was asked arrives late.
SLOW_STATE = """() => {
  const fetched = window.fetch.bind(window);
  window.fetch = async (input, init) => {
    const response = await fetched(input, init);
    const path = new URL(response.url).pathname;
    if ((init?.method ?? 'GET') === 'GET' && /^\\/sessions\\/[^/]+$/.test(path))
      await new Promise((resolve) => setTimeout(resolve, 1500));
    return response;
  };
}"""


def test_a_message_typed_as_a_session_opens_comes_after_its_history(
    browser: object, tmp_path: Path
) -> None:
    """A session opened over a slow connection takes no message until its history is
    shown: a message typed meanwhile comes after the history, once (the page sent it at
    once, and the history read before it came after its reply)."""
    from playwright.sync_api import Browser, expect

    assert isinstance(browser, Browser)
    store = f"sqlite:///{tmp_path / 'slow.db'}"
    with serve_command(store, "--agent", "chat_agents:echo") as server:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            r = client.post("/sessions/s/messages", json={"text": "hi"})
            assert r.status_code == 200, r.text
        page, errors = open_page(browser, f"{server.url}/")
        page.evaluate(SLOW_STATE)
        page.locator("#session-list button").first.click()
        expect(page.locator("#title")).to_have_text("s")
        page.fill("#text", "back again")
        page.press("#text", "Enter")
        shown = page.locator(".message")
        expect(shown).to_have_count(4, timeout=10_000)
        expect(shown).to_have_text(["hi", "hi", "back again", "back again"])
        assert errors == []


def test_a_message_queued_when_the_server_stopped_is_offered_to_send_again(
    browser: object, tmp_path: Path
) -> None:
    """A message sent while a long reply streams waits behind it; the server stops
    (SIGTERM, a short grace) before its turn began, and its stream ends unanswered: the
    page keeps it as not sent, with Send again, and sent again (with its key) to the
    server started anew it is answered. (It vanished from the page, though it was never
    in the history.)"""
    from playwright.sync_api import Browser, expect

    assert isinstance(browser, Browser)
    store = f"sqlite:///{tmp_path / 'queued.db'}"
    words = " ".join(f"w{i}" for i in range(200))  # (10 s of streaming)
    with open_proxy(0) as proxy:
        with serve_command(store, "--shutdown-grace", "0.5") as server:
            proxy.target_port = server.port
            page, errors = open_page(browser, f"http://127.0.0.1:{proxy.port}/#session=web-q")
            expect(page.locator("#title")).to_have_text("web-q")
            page.fill("#text", words)
            page.press("#text", "Enter")
            expect(page.locator(".message.streaming")).to_contain_text("w5", timeout=10_000)
            page.fill("#text", "queued behind")
            page.press("#text", "Enter")
            expect(page.locator("#outbox .outgoing")).to_contain_text("queued behind")
            time.sleep(0.5)  # (the message reached the session's mailbox)
        unsent = page.locator("#outbox .outgoing.failed")
        expect(unsent).to_contain_text("queued behind", timeout=10_000)
        expect(unsent).to_contain_text("not sent")  # (its stream ended unanswered)
        with serve_command(store) as again:
            proxy.target_port = again.port
            expect(page.locator("#status")).to_have_text("connected", timeout=15_000)
            unsent.locator("button.resend").click()
            expect(page.locator(".message.assistant").last).to_have_text(
                "queued behind", timeout=15_000
            )
            expect(unsent).to_have_count(0)
            page.close()
    assert not errors


def test_a_message_refused_while_a_review_waits_is_kept_to_send_again(
    browser: object, tmp_path: Path
) -> None:
    """A message sent while the session waits on a review is refused (its turn never
    began): the page says why and keeps the message as not kept, with Send again; once
    the review is resolved, sent again, it is answered. (It vanished from the page; and
    then its refusal was told twice.)"""
    from playwright.sync_api import Browser, expect

    assert isinstance(browser, Browser)
    store = f"sqlite:///{tmp_path / 'refused.db'}"
    with serve_command(store) as server:
        page, errors = open_page(browser, f"http://127.0.0.1:{server.port}/#session=web-r")
        expect(page.locator("#title")).to_have_text("web-r")
        page.fill("#text", "refund A1")
        page.press("#text", "Enter")
        review = page.locator(".review")
        expect(review).to_contain_text('refund({"order_id": "A1"})', timeout=10_000)
        page.fill("#text", "meanwhile")
        page.press("#text", "Enter")
        expect(page.locator(".message.error").last).to_contain_text("waiting on review")
        unsent = page.locator("#outbox .outgoing.failed")
        expect(unsent).to_contain_text("meanwhile", timeout=10_000)
        expect(unsent).to_contain_text("not kept: refused")
        expect(page.locator(".message.error")).to_have_count(1)  # (told once, not twice)
        review.locator("button.approve").click()
        expect(review).to_have_count(0, timeout=10_000)
        unsent.locator("button.resend").click()
        expect(page.locator(".message.assistant").last).to_have_text("meanwhile", timeout=15_000)
        expect(unsent).to_have_count(0)
        # the refusal told once (its stream's error and the session's TurnFailed both
        # came by now: the events after it did), in the gateway's words
        expect(page.locator(".message.error")).to_have_count(1)
        expect(page.locator(".message.error")).to_contain_text("POST /sessions/web-r/reviews/")
        page.close()
    assert not errors


def test_a_message_whose_turn_a_crash_lost_is_offered_to_send_again(
    browser: object, tmp_path: Path
) -> None:
    """The server is killed (kill -9) mid-reply and started again: the turn was never
    stored, so the page shows the history without it, says so, and keeps the message
    as not kept, with Send again; sent again, it is answered. (The message vanished
    without a word: the page showed "connected" and an empty session.)"""
    from playwright.sync_api import Browser, expect

    assert isinstance(browser, Browser)
    store = f"sqlite:///{tmp_path / 'crash.db'}"
    words = " ".join(f"w{i}" for i in range(60))
    with open_proxy(0) as proxy:
        with serve_command(store, status=-signal.SIGKILL) as server:
            proxy.target_port = server.port
            page, errors = open_page(browser, f"http://127.0.0.1:{proxy.port}/#session=web-k")
            expect(page.locator("#title")).to_have_text("web-k")
            page.fill("#text", "kept first")
            page.press("#text", "Enter")
            expect(page.locator(".message.assistant")).to_have_text("kept first", timeout=10_000)
            page.fill("#text", words)
            page.press("#text", "Enter")
            expect(page.locator(".message.streaming")).to_contain_text("w5", timeout=10_000)
            server.process.kill()
            server.process.wait()
        expect(page.locator("#status")).to_have_text("reconnecting", timeout=10_000)
        with serve_command(store) as again:
            proxy.target_port = again.port
            expect(page.locator("#status")).to_have_text("connected", timeout=15_000)
            expect(page.locator(".message.user")).to_have_text(["kept first"], timeout=10_000)
            expect(page.locator(".message.error")).to_contain_text("send it again")
            lost = page.locator("#outbox .outgoing.failed")
            expect(lost).to_contain_text(words)
            expect(lost).to_contain_text("not kept")
            lost.locator("button.resend").click()
            expect(page.locator(".message.assistant").last).to_have_text(words, timeout=15_000)
            expect(lost).to_have_count(0)
            page.close()
    assert not errors


@pytest.mark.redis
def test_a_turn_sent_again_after_its_worker_died_replaces_what_the_page_drew_of_it(
    browser: object, redis_url: str
) -> None:
    """Two `serve` workers on Redis; the page follows a session through worker B while
    the session runs on worker A. A is killed (kill -9) mid-reply; B sends the message
    again under its idempotency key, and the turn runs again on B under a new turn id
    (a second TurnStarted). The page drops what it drew of the first run: one user
    message, one answer, no draft left streaming; so does a tab opened as the first run
    streamed. (The first run's partial answer and a second copy of the user's message
    stayed for good.)"""
    from playwright.sync_api import Browser, expect

    assert isinstance(browser, Browser)
    prefix = f"sa-test:{uuid.uuid4().hex}"
    store = f"{redis_url}?prefix={prefix}"
    words = " ".join(f"w{i}" for i in range(60))
    ttl = ("--lease-ttl", "2")
    with (
        serve_command(store, *ttl, status=-signal.SIGKILL) as a,
        serve_command(store, *ttl) as b,
    ):
        worker_a = re.search(r"as worker (\S+) on", a.line)
        assert worker_a, a.line
        # a session that runs on A (sessions wake on their shard's worker of the two)
        names = [f"web-{i}" for i in range(24)]
        for name in names:
            reply = httpx.post(f"{b.url}/sessions/{name}/messages", json={"text": "hi"}, timeout=30)
            assert reply.status_code == 200, reply.text
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # (the page's loop runs here)
            owners = pool.submit(asyncio.run, lease_owners(redis_url, prefix, names)).result()
        name = next(n for n in names if owners[n] == worker_a.group(1))
        page, errors = open_page(browser, f"{b.url}/#session={name}")
        expect(page.locator("#title")).to_have_text(name)
        expect(page.locator(".message.assistant")).to_have_text("hi", timeout=10_000)
        page.fill("#text", words)
        page.press("#text", "Enter")
        expect(page.locator(".message.streaming")).to_contain_text("w5", timeout=10_000)
        # a tab opened as the first run streams (it did not draw that turn's start)
        late, late_errors = open_page(browser, f"{b.url}/#session={name}")
        expect(late.locator(".message.streaming")).to_contain_text("w9", timeout=10_000)
        a.process.kill()
        a.process.wait()
        for tab in (page, late):
            expect(tab.locator(".message.assistant").last).to_have_text(words, timeout=30_000)
            expect(tab.locator(".message.user")).to_have_text(["hi", words])
            expect(tab.locator(".message.assistant")).to_have_text(["hi", words])
            expect(tab.locator(".message.streaming")).to_have_count(0)
            tab.close()
    assert not errors
    assert not late_errors


async def lease_owners(url: str, prefix: str, names: list[str]) -> dict[str, str | None]:
    """The worker that holds the lease of each session of ``names`` on the Redis at
    ``url`` under ``prefix`` (the store's documented layout), if any."""
    import coredis

    owners: dict[str, str | None] = {}
    async with coredis.Redis.from_url(url, decode_responses=True) as client:
        for name in names:
            raw = name.encode()
            encoded = base64.urlsafe_b64encode(raw).rstrip(b"=").decode()
            key = f"{prefix}:{{g{zlib.crc32(raw) % 1024}}}:s:{encoded}:lease"
            owners[name] = await client.hget(key, "owner")
    return owners
