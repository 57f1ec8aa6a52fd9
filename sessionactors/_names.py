"""Session name rules: non-empty, at most 256 UTF-8 bytes, no control characters."""

from __future__ import annotations

import re
from typing import Final

from ._errors import InvalidSessionNameError, shown
from ._records import control_character, is_control

__all__ = [
    "MAX_NAME_BYTES",
    "as_session_id",
    "damaged_name",
    "delete_command",
    "is_url",
    "json_escape",
    "name_bytes",
    "redact",
    "redact_urls",
    "shell_quoted",
    "stored_name",
    "terminal_safe",
    "validate_name",
]

MAX_NAME_BYTES = 256


def as_session_id(name: str) -> str | None:
    """``name`` as the ``session_id`` of an error about it: None if it is longer than
    any session name (a client may send a name, a cursor, of any length), so that an
    error never repeats it whole."""
    return name if len(name.encode("utf-8", "surrogatepass")) <= MAX_NAME_BYTES else None


def validate_name(name: object) -> str:
    """Return ``name`` if it is a valid session name, else raise InvalidSessionNameError."""
    if not isinstance(name, str):
        raise InvalidSessionNameError(
            f"session name must be a str, not {type(name).__name__}; pass the name as text",
            session_id=None,
        )
    if not name:
        raise InvalidSessionNameError(
            "session name is empty; give every session a non-empty name", session_id=name
        )
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidSessionNameError(
            f"session name {shown(name)} is not valid unicode (lone surrogate); use printable text",
            session_id=None,
        ) from None
    if size > MAX_NAME_BYTES:
        raise InvalidSessionNameError(  # (no session_id: it names no session, at any length)
            f"session name {shown(name)} is {size} UTF-8 bytes, over the limit of "
            f"{MAX_NAME_BYTES}; use a shorter name (a hash of a long key works)",
            session_id=None,
        )
    ch = control_character(name)
    if ch is not None:
        raise InvalidSessionNameError(
            f"session name {name!r} contains the control character {ch!r}; "
            "use printable characters only",
            session_id=name,
        )
    return name


def damaged_name(name: str) -> bytes | None:
    """The stored bytes of a name that is not UTF-8, or None for a name that is text.

    A store that reads a name from bytes that damage left undecodable (bit rot in a
    SQLite file) gives it as those bytes decoded with ``surrogateescape``, as Python
    decodes a command line's arguments: ``$'\\xff19'`` in a shell is the same str.
    No session can have such a name (``validate_name`` refuses it): listings leave it
    out, and the command line's ``sessions delete`` takes it to remove what the store
    holds of it (a SQLite file's rows, a Redis store's keys: see ``name_bytes``).
    """
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        try:
            return name.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:
            return None
    return None


def stored_name(raw: bytes) -> str:
    """The name a store read as the bytes ``raw``: their UTF-8 text, or for bytes that
    are not UTF-8 (damage) the str that ``damaged_name`` takes back to them."""
    return bytes(raw).decode("utf-8", "surrogateescape")


def name_bytes(name: str) -> bytes:
    """The bytes a store keeps for ``name`` (the inverse of ``stored_name``): its UTF-8,
    or a damaged name's own bytes."""
    try:
        return name.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # (a lone surrogate that stands for no byte: never valid)
        return name.encode("utf-8", "surrogatepass")


def shell_quoted(raw: bytes) -> str:
    """``raw`` as a shell's ``$'...'`` word that passes those bytes (bash, zsh, ksh):
    printable ASCII as is, every other byte as ``\\xHH``."""
    return (
        "$'"
        + "".join(chr(b) if 0x20 <= b < 0x7F and b not in b"'\\" else f"\\x{b:02x}" for b in raw)
        + "'"
    )


def delete_command(word: str, store: str = "--store URL") -> str:
    """The command line that deletes a session from a store, as every hint of it is
    spelled: ``word`` is the session's name as a shell word (quoted, or a damaged
    name's ``$'...'``), ``store`` the option that names the store, as shell words (a
    placeholder by default; none, for a store that the environment names)."""
    after = "-- " if word.startswith("-") else ""  # (else read as an option)
    store = f"{store} " if store else ""
    return f"python -m sessionactors sessions delete {store}--yes {after}{word}"


def redact(url: str) -> str:
    """``url`` (a store's, or any text given as one) with ``***`` in place of its
    password, as every message and log line shows it: the password of its user info
    (up to the last ``@``, even where a reserved character the password did not encode
    ends the URL's host part early, or where a slash is missing after the scheme) and
    the value of a query option whose name holds ``password``. A user name is kept
    (``redis://ops:***@host/0``); so is a URL with no password, and the path of a URL
    that names a file and no host (``sqlite:///d/u:x@y.db``, ``unix:///run/r.sock``),
    which holds no user info."""
    scheme = _SCHEME.match(url)
    head = scheme.group() if scheme is not None and scheme.group().endswith("/") else ""
    rest = url[len(head) :]
    userinfo, at, hosts = rest.rpartition("@")
    if at and ":" in userinfo and not _names_a_file(head):
        rest = f"{userinfo.partition(':')[0]}:***@{hosts}"
    path, mark, query = rest.partition("?")
    if mark:
        query = "&".join(
            f"{key}=***" if "password" in key.lower() else item
            for item in query.split("&")
            for key in (item.partition("=")[0],)
        )
        rest = f"{path}?{query}"
    return f"{head}{rest}"


def is_url(text: str) -> bool:
    """Whether ``text`` begins as a URL: a scheme and a slash (``redis://``,
    ``sqlite:///``, ``redis:/`` a slash short), as :func:`redact` reads one."""
    scheme = _SCHEME.match(text)
    return scheme is not None and scheme.group().endswith("/")


def redact_urls(text: str) -> str:
    """``text`` (a message) with every URL in it redacted as ``redact`` does: a URL runs
    from its scheme to the quote that closes it, where a quote opens it (as ``repr``
    quotes a value: a space in the URL is then in it), else to the next whitespace."""
    return _URL_IN_TEXT.sub(_redact_match, text)


def _redact_match(match: re.Match[str]) -> str:
    for quote, group in (("'", "single"), ('"', "double")):
        if (url := match.group(group)) is not None:
            return f"{quote}{redact(url)}{quote}"
    return redact(match.group())


def _names_a_file(head: str) -> bool:
    """Whether a URL that begins with ``head`` (its scheme and the slashes after it)
    names a file and no host: ``sqlite:///`` or ``unix:///``, whose user info would have
    to come before the third slash. Any other scheme (a Redis one, one unknown) is
    taken to have a host, so that its user info is redacted however it is written."""
    scheme, _, slashes = head.partition(":")
    return scheme.lower() in _FILE_SCHEMES and len(slashes) >= 3


#: A URL's scheme with the slashes after it (``redis://``; ``redis:/``, a slash short).
_SCHEME: Final = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*:/*")
#: The schemes of URLs that name a file (``sqlite:///path``, ``unix:///path``).
_FILE_SCHEMES: Final = frozenset({"sqlite", "unix"})
#: A URL in a message: quoted (to the quote that closes it), or to the next whitespace;
#: a scheme begins a word (not a path's part: ``/srv/a:b`` is none).
_URL_IN_TEXT: Final = re.compile(
    r"'(?P<single>[A-Za-z][A-Za-z0-9+.\-]*:[^']*)'"
    r"|\"(?P<double>[A-Za-z][A-Za-z0-9+.\-]*:[^\"]*)\""
    r"|(?<![A-Za-z0-9+.\-/])[A-Za-z][A-Za-z0-9+.\-]*:\S*"
)


def terminal_safe(text: str, *, one_line: bool = False) -> str:
    """``text`` with every control or format character but newline, tab and the
    zero-width joiner of emoji (an ANSI escape, a carriage return, a bidirectional
    override) written as ``\\uXXXX``, so that what a session or a client sent never
    reaches a terminal or a log raw; with ``one_line``, newlines and tabs too (a line
    of a log, which a newline would split into a forged second line). JSON text stays
    the same JSON: such characters are only in its strings, where the escape means the
    same."""
    safe = _SUSPECT.sub(_escape, text)
    if one_line:
        safe = safe.replace("\n", "\\u000a").replace("\t", "\\u0009")
    return safe


def _escape(match: re.Match[str]) -> str:
    ch = match.group()
    return json_escape(ch) if is_control(ch) else ch


def json_escape(ch: str) -> str:
    """The character ``ch`` as JSON escapes it: ``\\uXXXX``, a UTF-16 surrogate pair
    past the first 65,536."""
    code = ord(ch)
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    code -= 0x10000  # (as JSON writes it: a UTF-16 surrogate pair)
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


#: The characters ``terminal_safe`` looks at: all but newline, tab, printable ASCII and
#: the blocks of letters that hold no control or format character (Latin to Hebrew,
#: Devanagari to Khmer, CJK, Hangul), so that text in those scripts goes fast.
_SUSPECT: Final = re.compile(
    "[^\t\n\x20-\x7e\xa0-\xac\xae-\u05ff\u0900-\u17ff\u3000-\u9fff\uac00-\ud7ff]"
)
