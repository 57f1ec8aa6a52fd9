"""The documentation's examples run, quote their files exactly, and use only the public API."""

import ast
import datetime
import importlib
import json
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

import sessionactors as sa
from sessionactors.testing import export_document
from test_public_api import NAMESPACES

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
EXAMPLES = sorted((DOCS / "examples").glob("*.py"))
PAGES = sorted(DOCS.rglob("*.md"))
TEXT_FILES = sorted(p for p in DOCS.rglob("*") if p.is_file() and p.suffix in (".py", ".md"))

# What each example must print (substrings of its standard output). Every example has an
# entry, so that each one shows something a reader, and this test, can check.
EXPECTED = {
    "tutorial_01_first_registry.py": [
        "reply: Say hi to Ada.",
        "spawn again: session 'support-123' already exists",
        "same session: True",
    ],
    "tutorial_02_submit.py": [
        "submitted: 3 turns",
        "'message 0' answered turn True",
        "'message 2' answered turn True",
        "nowait: one more",
    ],
    "tutorial_03_history.py": [
        "     user: Hello there.",
        "assistant: How are you?",
        "status: idle | messages: 4",
        "listed: chat-1 4 {'tenant': 'acme'}",
    ],
    "tutorial_04_streaming.py": [
        ": StatusChanged\nseq ",
        ": TurnStarted\nseq ",
        ": Delta\nseq ",
        ": TurnFinished\nreply",
        "seqs one apart: True",
        "reply: one two three",
        "streamed: four five six",
    ],
    "tutorial_05_hibernate.py": [
        "after hibernate, live: []",
        "history after waking: ['Remember me.', 'Remember me.']",
        "live again: ['chat-1']",
        "after idling, live: []",
        "status: hibernated",
        "not found: session 'nobody' does not exist",
    ],
    "tutorial_06_restart.py": [
        "reply: After the restart.",
        "history: ['Before the restart.', 'Before the restart.', 'After the restart.', "
        "'After the restart.']",
        "replayed: 2 finished turns",
    ],
    "howto_operations.py": [
        "read without waking: chat-1 2 messages",
        "acme's sessions: ['chat-3', 'chat-1']",
        "export format sessionactors.session version 1",
        "imported session 'chat-1-copy' (2 messages)",
        "deleted session 'chat-1'",
        "the copy answers: Still there? (4 messages)",
    ],
    "howto_copy_store.py": [
        "copied session 'chat-3' (2 messages)\ncopied session 'chat-2' (2 messages)\n"
        "copied session 'chat-1' (2 messages)\n3 copied, 0 skipped, 0 failed\nexit status 0",
        "again: 0 copied, 3 skipped, 0 failed (exit status 0)",
        "a replay from before the copy: EventsExpiredError",
        "followed on to the reply: Still there?",
        "the copy answers: Still there? (4 messages)",
    ],
    "howto_durability.py": [
        "durability='turn': journaled at reply time: "
        "['StatusChanged', 'TurnStarted', 'TurnFinished']",
        "durability='hibernate': journaled at reply time: ['StatusChanged']",
        "2 messages after a clean restart",
        "journal tail 17 entries",
        "replay from 0 expired; oldest available seq:",
    ],
    "howto_resume_stream.py": [
        "resumed without gaps: True",
        "lagged; last seq delivered:",
        "caught up without gaps: True",
        "expired; oldest available seq:",
        "next event after the reload: True",
    ],
    "howto_http_stream.py": [
        "events sent: 5",
        "last event: event: done",
        "client gone after 2 events",
        "after reconnecting: event: done",
        "assistant kept: a reply nobody reads to the end",
    ],
    "howto_shutdown.py": [
        "quick: done in time",
        "slow: SessionStoppedError:",
        "queued: SessionStoppedError:",
        "interrupted=True",
        "outcome: failed | SessionStoppedError: ",
    ],
    "howto_timeouts.py": [
        "gave up waiting after 0.25 s",
        "finished anyway: one two three four five six",
        "cancelled one: True",
        "the waiter gets TurnCancelledError",
        "interrupted=True",
        "cut by the agent's limit: TurnTimeoutError",
        "kept: 'two words' interrupted=True",
    ],
    "howto_idempotency.py": [
        "same reply: True | same turn: True",
        "model asked: 1 time(s)",
        "history: 2 messages",
        "replayed: True",
        "joined: True True",
        "history: 4 messages",
    ],
    "howto_turn_outcomes.py": [
        "status: failed | RuntimeError: provider unavailable",
        "  assistant: Your order (interrupted=True)",
        "retried: It ships tomorrow.",
        "history: ['When does my order ship?', 'It ships tomorrow.']",
        "now: finished",
        "nothing to retry: NothingToRetryError",
        "unknown id: TurnNotFoundError",
    ],
    "howto_tool_context.py": [
        "[tool for chat-42, call call-7]",
        'Your orders: ["A1002 (open)"]',
        "ToolOutcome(content='[\"B2001 (open)\"]', is_error=False)",
    ],
    "howto_tools_review.py": [
        "the model is told about: ['lookup_order', 'refund']",
        "waiting on reviews: 1 | refunds so far: []",
        "review: support-1 refund",
        "busy: resolve the review first",
        "reply: Order A1001 is refunded. | refunds: ['A1001']",
    ],
    "howto_manage_sessions.py": [
        "page 1: ['customer-6', 'customer-5', 'customer-4']",
        "page 2: ['customer-3', 'customer-2', 'customer-1']",
        "gold: ['customer-6', 'customer-3', 'customer-0']",
        "hibernated: 7",
        "metadata: {'tier': 'gold'}",
        "no turn: session 'customer-1' runs agent 'support', which this registry does not have",
        "gold now: ['customer-0', 'customer-1', 'customer-3', 'customer-6']",
    ],
    "howto_history.py": [
        "fork: ['message 0', 'message 1']",
        "rewind removed 4: ['message 0', 'message 1', 'message 2']",
        "truncate removed 4: ['message 2']",
        "summary: The user counted from 0 to 1.",
    ],
    "howto_add_messages.py": [
        "   system: Ada (human agent) joined the chat.",
        "the model saw 7 messages",
        "refused: tool call 'call_1' of message 'late' has no result",
        "after replace: 4 messages",
    ],
    "howto_compaction.py": [
        "compactions: 5",
        "summary: The user counted upwards.",
        "the summarizer saw: user: this is message number 0",
    ],
    "howto_testing.py": [
        "passed: test_greet_replies_in_the_session",
        "passed: test_the_model_sees_the_system_prompt_first",
        "passed: test_a_model_failure_fails_the_turn_not_the_session",
        "passed: test_a_turn_held_open_can_be_cancelled",
    ],
    "howto_testing_crash.py": [
        "cancelled: the next process finds ['hello', 'hello']",
        "crashed: the next process finds []",
    ],
    "howto_testing_stores.py": [
        "passed: test_a_store_fault_crashes_the_session_and_it_restarts",
        "passed: test_a_stalled_store_holds_the_reply_until_the_write_lands",
        "passed: test_the_durability_check_passes_and_catches_a_store_that_loses_writes",
        "flaws: lose_appends, ack_appends_early, lose_snapshots",
    ],
    "howto_custom_store.py": [
        "implements the protocol: True",
        "check_store: passed",
        "a broken store fails:",
        "reply: stored in dicts",
        "stored sessions: ['chat']",
    ],
    "howto_custom_store_asyncio.py": [
        "check_store: passed",
        "reply: stored through asyncio",
        "woken with: 2 messages",
        "stored sessions: ['chat']",
    ],
    "howto_observability.py": [
        "reply: It shipped.",
        "this answer: Usage(input_tokens=160, output_tokens=4)",
        "session total: 302 tokens",
        "listed: 280 in, 22 out",
        "invoke_agent support\n  chat ScriptedModel\n  chat ScriptedModel\n"
        "  execute_tool lookup_order\n    orders.select",
        "gen_ai.client.token.usage input: 280",
        "sessionactors.turns finished: 1",
    ],
    "howto_redis.py": [
        "RedisStore('rediss://:***@redis.example.com:6380/0', prefix='sessionactors') "
        "demands persistence='always'",
        "RedisStore('redis+cluster://10.0.0.1:7000,10.0.0.2:7000'",
        "everysec\nvolatile\n",
        "waits for 1 replica(s), 0.5 s at most\n2\n",
        "refused: redis url 'redis+sentinel://10.0.0.5:26379' names no service",
    ],
    "howto_openai.py": [
        "reply: Order A1001 is shipped",
        "roles: ['user', 'assistant', 'tool', 'assistant']",
        "cut short: It left the {'finish_reason': 'length'}",
    ],
    "howto_nested_sessions.py": [
        'The workers said: {"w1": "on it: summarise the report", "w2": "on it: summarise',
        "(refused: session 'boss' is running the turn this request comes from",
        '"w1": "on it: and you?"',
    ],
    "howto_model_adapter.py": [
        "reply: Order A1001 is shipped.",
        "roles: ['user', 'assistant', 'tool', 'assistant']",
        "cut short: It left the warehouse on {'finish_reason': 'max_tokens'}",
    ],
    "howto_asyncio.py": [
        "reply: Order A1001 is shipped.",
        "roles: ['user', 'assistant', 'tool', 'assistant']",
        "streamed: ['streamed ', 'word ', 'by ', 'word ']",
        "gave up waiting",
        "kept: a reply that takes a while to write",
        "not found: session 'nobody' does not exist",
    ],
    "howto_asyncio_starlette.py": [
        "reply: hello over HTTP",
        "streamed: streamed word by word",
        "bad input: 422 a message to session 'bob' must be str, not int",
        "not JSON: 422",
        "retried: 200 a keyed message",
        "key reused: 422 session 'ada' already took idempotency key 'k-1' for another message",
        "after a restart: 6 messages",
        "sessions: ['ada']",
    ],
    "howto_gateway_trio.py": [
        "reply: hello over HTTP",
        "events: ['TurnStarted', 'Delta', 'Delta', 'Delta', 'TurnFinished']",
        "['Delta', 'Delta', 'TurnFinished']",
        "error: 404 SessionNotFoundError",
        "without the token: 401",
    ],
    "howto_gateway_uvicorn.py": [
        "reply: served by uvicorn",
        "sessions: ['grace']",
        "bad input: 422 session 'grace': 'text' must be a string, got int",
    ],
    "howto_gateway_mounted.py": [
        "own route: ['TurnStarted', 'Delta', 'Delta', 'Delta', 'TurnFinished']",
        "gateway: ['TurnStarted', 'Delta', 'Delta', 'TurnFinished']",
        "messages: 4 | metadata: {'tenant': 'acme'}",
    ],
    "explanation_supervision.py": [
        "crashed: OSError - simulated disk fault",
        "history: ['first', 'first']",
        "restarts: 1",
        "seq still rising: True",
        "next reply: third",
        "bystander: unaffected",
    ],
    "explanation_unclean_stop.py": [
        "woken with 2 messages",
        "jumped by about 2**20: True",
    ],
}

# An example quoted in a page: the marker line, then a python fence holding the file's text.
QUOTE = re.compile(
    r"<!-- example: (?P<path>[\w./-]+) -->\n```python\n(?P<code>.*?)^```$",
    re.DOTALL | re.MULTILINE,
)

# Any module or name of sessionactors with a leading "_", however it is imported: absolute,
# relative, a private module of a public package, or a private name from a public module.
PRIVATE_IMPORT = re.compile(
    r"^\s*(?:"
    r"(?:from|import)\s+sessionactors(?:\.\w+)*\._\w*"
    r"|from\s+\.+_\w*"
    r"|from\s+(?:sessionactors(?:\.\w+)*|\.+)\s+import\s+\(?\s*_"
    r")",
    re.MULTILINE,
)


def quotes() -> list[tuple[Path, str, str]]:
    """(page, quoted path relative to docs/, quoted code) for every quote in every page."""
    return [
        (page, match["path"], match["code"])
        for page in PAGES
        for match in QUOTE.finditer(page.read_text())
    ]


def test_there_are_examples_and_pages() -> None:
    """The docs have example programs and the four kinds of pages."""
    assert EXAMPLES
    for part in ("tutorial", "howto", "reference", "explanation"):
        assert (DOCS / part / "index.md").is_file(), part


def run_python(script: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run ``script`` with this Python in ``cwd`` (60 s at most), its output captured."""
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs_and_prints_what_the_docs_say(example: Path, tmp_path: Path) -> None:
    """Each example exits with status 0 within 60 s and prints its expected lines."""
    done = run_python(example, tmp_path)
    assert done.returncode == 0, f"{example.name} failed:\n{done.stdout}\n{done.stderr}"
    assert example.name in EXPECTED, f"add the expected output of {example.name} to EXPECTED"
    for line in EXPECTED[example.name]:
        assert line in done.stdout, f"{example.name} did not print {line!r}:\n{done.stdout}"
    printed = done.stdout.splitlines()
    for page, shown in shown_outputs(example):
        told = f"{page.name} shows what {example.name} prints as {shown}, but it prints {printed}"
        assert len(shown) == len(printed), told
        assert all(re.fullmatch(_shown_line(a), b) for a, b in zip(shown, printed, strict=True)), (
            told
        )


# What a page shows an example printing: "It prints:" and a text fence, after its quote.
SHOWN = re.compile(r"\s*It prints:\n\n```text\n(?P<text>.*?)^```$", re.DOTALL | re.MULTILINE)


def shown_outputs(example: Path) -> list[tuple[Path, list[str]]]:
    """(page, lines) for each page that quotes ``example`` and shows what it prints."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in QUOTE.finditer(text):
            if Path(match["path"]).name == example.name:
                shown = SHOWN.match(text, match.end())
                if shown is not None:
                    found.append((page, shown["text"].splitlines()))
    return found


def _shown_line(line: str) -> str:
    """A pattern for a printed line as a page shows it: a seq (ten digits or more, from
    the clock: see resume-stream.md) stands for any."""
    return r"\d{10,}".join(re.escape(part) for part in re.split(r"\d{10,}", line))


def test_every_expectation_has_its_example() -> None:
    """No expectation is left over from a renamed or removed example."""
    assert set(EXPECTED) <= {p.name for p in EXAMPLES}


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_has_main_and_runs_it_with_trio(example: Path) -> None:
    """Each example defines ``async def main()`` and ends with ``trio.run(main)`` (or, for
    the asyncio how-tos, ``asyncio.run(main())``)."""
    tree = ast.parse(example.read_text())
    mains = [
        node for node in tree.body if isinstance(node, ast.AsyncFunctionDef) and node.name == "main"
    ]
    assert mains, f"{example.name} has no top-level async def main()"
    text = example.read_text()
    assert (
        'if __name__ == "__main__":\n    trio.run(main)\n' in text
        or 'if __name__ == "__main__":\n    asyncio.run(main())\n' in text
    )


def test_every_example_is_quoted_in_a_page() -> None:
    """Every example file is quoted, in full, by at least one Markdown page."""
    quoted = {(DOCS / path).resolve() for _, path, _ in quotes()}
    missing = [p.name for p in EXAMPLES if p.resolve() not in quoted]
    assert not missing, f"examples no page quotes: {missing}"


def test_quoted_examples_match_their_files() -> None:
    """Each quote holds its file's current text (run docs/sync_examples.py to update)."""
    assert quotes()
    for page, path, code in quotes():
        file = DOCS / path
        assert file.is_file(), f"{page.relative_to(ROOT)} quotes a missing file {path}"
        assert code == file.read_text(), (
            f"{page.relative_to(ROOT)} quotes an old version of {path}; "
            "run .venv/bin/python docs/sync_examples.py"
        )


def test_page_links_point_to_files() -> None:
    """Relative links between the pages and to the examples lead to existing files."""
    link = re.compile(r"\]\(((?!https?:|#)[^)#\s]+)(?:#[^)]*)?\)")
    for page in PAGES:
        for target in link.findall(page.read_text()):
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links to {target}"


@pytest.mark.parametrize("path", TEXT_FILES, ids=[str(p.relative_to(DOCS)) for p in TEXT_FILES])
def test_docs_import_no_private_module(path: Path) -> None:
    """No file under docs/ imports a private module or name of sessionactors."""
    found = PRIVATE_IMPORT.findall(path.read_text())
    assert not found, f"{path.relative_to(ROOT)} imports private names: {found}"


def test_private_import_check_catches_private_imports() -> None:
    """The private-import pattern flags each form of private import (negative control)."""
    _ = "_"  # written apart, so that this file imports nothing private even to a grep
    for line in [
        f"from sessionactors.{_}registry import Registry",
        f"import sessionactors.{_}codec",
        f"from sessionactors.stores.{_}base import Store",
        f"from .{_}actor import Actor",
        f"from .. import {_}records",
        f"from sessionactors import {_}errors",
        f"    from sessionactors.testing.{_}models import EchoModel",
    ]:
        assert PRIVATE_IMPORT.search(line), line
    for line in [
        "import sessionactors as sa",
        "from sessionactors.stores import SQLiteStore",
        "from sessionactors.testing import EchoModel, check_store",
        "from sessionactors.models import OpenAIChatModel",
    ]:
        assert not PRIVATE_IMPORT.search(line), line


def test_reference_lists_every_public_name() -> None:
    """The reference page has an entry for every public name of the public namespaces."""
    text = (DOCS / "reference" / "index.md").read_text()
    missing = []
    for namespace in NAMESPACES:
        module = importlib.import_module(namespace)
        names = getattr(module, "__all__", None) or [
            n
            for n in dir(module)
            if not n.startswith("_") and not isinstance(getattr(module, n), types.ModuleType)
        ]
        missing += [
            f"{namespace}.{n}" for n in names if f'<a id="{namespace}.{n}"></a>' not in text
        ]
    assert not missing, (
        f"the reference lacks {missing}; run .venv/bin/python docs/reference/generate.py"
    )


def test_the_readme_example_runs_and_prints_its_replies(tmp_path: Path) -> None:
    """The README's short example, the first code a newcomer runs, runs as written (in a
    fresh directory, where it makes its sessions.db) and prints both replies."""
    readme = (DOCS.parent / "README.md").read_text()
    [code] = re.findall(r"```python\n(.*?)```", readme, flags=re.DOTALL)
    script = tmp_path / "readme_example.py"
    script.write_text(code)
    done = run_python(script, tmp_path)
    assert done.returncode == 0, f"the README's example failed:\n{done.stdout}\n{done.stderr}"
    assert "Say hi to Ada." in done.stdout
    assert "And what is its status?" in done.stdout
    assert (tmp_path / "sessions.db").is_file()


def test_the_export_formats_sample_shows_every_field_an_export_holds() -> None:
    """The export format's sample in operations.md shows every field of an export and
    of its ``session``, as ``sessions export`` writes them."""
    page = (DOCS / "howto" / "operations.md").read_text(encoding="utf-8")
    section = page.split("## The export format", 1)[1]
    sample = json.loads(section.split("```json\n", 1)[1].split("```", 1)[0])
    now = datetime.datetime.now(datetime.UTC)
    written = export_document(sa.SessionState(session_id="chat-1", created_at=now, updated_at=now))
    assert list(sample) == list(written)
    assert list(sample["session"]) == list(written["session"])
