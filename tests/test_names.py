"""Session names: non-empty str, at most 256 UTF-8 bytes, no control characters."""

from __future__ import annotations

import sys
import unicodedata

import pytest
import trio

import sessionactors as sa

INVALID_NAMES = [
    pytest.param("", id="empty"),
    pytest.param("a" * 257, id="257-ascii"),
    pytest.param("é" * 128 + "a", id="257-two-byte"),
    pytest.param("a" * 255 + "é", id="two-byte-char-across-the-limit"),
    pytest.param("a" * 254 + "€", id="three-byte-char-across-the-limit"),
    pytest.param("a" * 253 + "😀", id="four-byte-char-across-the-limit"),
    pytest.param("é" * 256, id="256-chars-512-bytes"),
    pytest.param("nul\x00", id="nul"),
    pytest.param("tab\there", id="tab"),
    pytest.param("line\nbreak", id="newline"),
    pytest.param("carriage\rreturn", id="carriage-return"),
    pytest.param("\x1b[31mred", id="escape"),
    pytest.param("del\x7f", id="del"),
    pytest.param("next\x85line", id="c1-control"),
    pytest.param("zero\u200bwidth", id="format-char"),
    pytest.param("\ufeffbom", id="byte-order-mark"),
    pytest.param("evil\u202etxt.exe", id="bidi-override"),
    pytest.param("line\u2028sep", id="line-separator"),
    pytest.param("para\u2029sep", id="paragraph-separator"),
    pytest.param("lone\ud800surrogate", id="lone-surrogate"),
]

NOT_STR = [
    pytest.param(None, id="None"),
    pytest.param(42, id="int"),
    pytest.param(b"bytes", id="bytes"),
    pytest.param(["a"], id="list"),
]

VALID_NAMES = [
    pytest.param("a", id="one-char"),
    pytest.param("a" * 256, id="256-ascii"),
    pytest.param("é" * 128, id="256-bytes-two-byte"),
    pytest.param("a" * 254 + "é", id="two-byte-char-at-the-limit"),
    pytest.param("a" * 253 + "€", id="three-byte-char-at-the-limit"),
    pytest.param("a" * 252 + "😀", id="four-byte-char-at-the-limit"),
    pytest.param("😀" * 64, id="256-bytes-emoji"),
    pytest.param("support-123", id="plain"),
    pytest.param("tenant/user:42 chat", id="punctuation-and-space"),
    pytest.param("../../etc/passwd", id="path-like"),
    pytest.param("👩\u200d💻", id="zero-width-joiner"),
    pytest.param("日本語のセッション", id="cjk"),
    pytest.param("no\u00a0break", id="no-break-space"),
    pytest.param("private\ue000use", id="private-use"),
    pytest.param("unassigned\u0378", id="unassigned"),
]


@pytest.mark.parametrize("name", INVALID_NAMES + NOT_STR)
async def test_invalid_names_are_refused_everywhere(
    name: object, echo_agents: dict[str, sa.Agent]
) -> None:
    """Every entry point refuses an invalid name with InvalidSessionNameError, a ValueError."""
    async with sa.open_registry(agents=echo_agents) as registry:
        with pytest.raises(sa.InvalidSessionNameError) as info:
            registry.ref(name)  # type: ignore[arg-type]
        with trio.fail_after(10):
            with pytest.raises(sa.InvalidSessionNameError):
                await registry.spawn(name)  # type: ignore[arg-type]
            with pytest.raises(sa.InvalidSessionNameError):
                await registry.get_or_spawn(name)  # type: ignore[arg-type]
            with pytest.raises(sa.InvalidSessionNameError):
                await registry.delete(name)  # type: ignore[arg-type]
            assert await registry.sessions() == []

    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, sa.SessionActorsError)
    assert "session name" in str(info.value)


@pytest.mark.parametrize("name", VALID_NAMES)
async def test_valid_names_work_through_hibernation(
    name: str, echo_agents: dict[str, sa.Agent]
) -> None:
    """A valid name, up to exactly 256 UTF-8 bytes, can be spawned, talked to, hibernated
    and woken under the same name."""
    async with sa.open_registry(agents=echo_agents) as registry:
        with trio.fail_after(10):
            ref = await registry.spawn(name)
            await ref.send("hello")
            await ref.hibernate()
            (info,) = await registry.sessions()
            history = await registry.ref(name).history()

    assert info.session_id == name
    assert [m.content for m in history] == ["hello", "hello"]


async def test_a_name_is_refused_for_exactly_the_control_characters(
    echo_agents: dict[str, sa.Agent],
) -> None:
    """Of every character (lone surrogates aside), a name refuses exactly the control,
    format and line or paragraph separator characters, the zero-width joiner aside."""
    refused = []
    async with sa.open_registry(agents=echo_agents) as registry:
        for code in range(sys.maxunicode + 1):
            if 0xD800 <= code <= 0xDFFF:
                continue
            try:
                registry.ref(f"a{chr(code)}")
            except sa.InvalidSessionNameError:
                refused.append(code)
    control = [
        code
        for code in range(sys.maxunicode + 1)
        if not 0xD800 <= code <= 0xDFFF
        and unicodedata.category(chr(code)) in ("Cc", "Cf", "Zl", "Zp")
        and code != 0x200D
    ]
    assert refused == control


async def test_name_error_messages_say_what_to_do(echo_agents: dict[str, sa.Agent]) -> None:
    """The name errors say what is wrong and, for a long name, how long it is."""
    async with sa.open_registry(agents=echo_agents) as registry:
        with pytest.raises(sa.InvalidSessionNameError, match="empty"):
            registry.ref("")
        with pytest.raises(sa.InvalidSessionNameError, match="257 UTF-8 bytes"):
            registry.ref("a" * 255 + "é")
        with pytest.raises(sa.InvalidSessionNameError, match="control character"):
            registry.ref("a\nb")
        with pytest.raises(sa.InvalidSessionNameError, match="must be a str, not int"):
            registry.ref(7)  # type: ignore[arg-type]
