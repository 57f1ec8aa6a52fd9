"""Session name rules: non-empty, at most 256 UTF-8 bytes, no control characters."""

from __future__ import annotations

import unicodedata

from ._errors import InvalidSessionNameError, shown

__all__ = [
    "MAX_NAME_BYTES",
    "as_session_id",
    "damaged_name",
    "name_bytes",
    "shell_quoted",
    "stored_name",
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
    for ch in name:
        if unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp") and ch != "\u200d":
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
