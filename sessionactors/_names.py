"""Session name rules: non-empty, at most 256 UTF-8 bytes, no control characters."""

from __future__ import annotations

import unicodedata

from ._errors import InvalidSessionNameError

__all__ = ["MAX_NAME_BYTES", "validate_name"]

MAX_NAME_BYTES = 256


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
            f"session name {name[:40]!r} is not valid unicode (lone surrogate); use printable text",
            session_id=None,
        ) from None
    if size > MAX_NAME_BYTES:
        raise InvalidSessionNameError(
            f"session name {name[:40]!r}... is {size} UTF-8 bytes, over the limit of "
            f"{MAX_NAME_BYTES}; use a shorter name (a hash of a long key works)",
            session_id=name,
        )
    for ch in name:
        if unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp") and ch != "\u200d":
            raise InvalidSessionNameError(
                f"session name {name!r} contains the control character {ch!r}; "
                "use printable characters only",
                session_id=name,
            )
    return name
