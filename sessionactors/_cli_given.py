"""A value the command line takes from an option, a file or an environment variable
(a store's URL, the gateway's token), so that a secret in it need not show in the
process list: read and refused alike for each, never repeated in a refusal."""

from __future__ import annotations

import os
from typing import Final

__all__ = ["MAX_GIVEN_FILE", "read_given"]

#: The most characters a file that gives a value is read for: far more than a URL or a
#: token (a device that never ends, /dev/zero, or a large file given by mistake is
#: refused rather than read without bound).
MAX_GIVEN_FILE: Final = 64 * 1024


def read_given(
    value: str | None,
    path: str | None,
    *,
    option: str,
    file_option: str,
    variable: str | None,
    what: tuple[str, str],
) -> tuple[str, str] | None:
    """The value that ``option`` (``value``), ``file_option`` (the file at ``path``) or
    the environment ``variable`` (None: none) gives, in that order, with where it came
    from (one of the three names); None for none of them. A file's or the variable's surrounding
    whitespace is dropped (``export X="$(cat f)"`` is the same). ``what`` names the
    value in messages, as ``("the store's URL", "a store's URL")``.

    Raises ``ValueError`` for both options given, for a file that cannot be read, is
    empty, holds more than one line or more than ``MAX_GIVEN_FILE`` characters, and for
    a variable that is empty or of more than one line: its message names the file or
    the variable, never what it holds. A file's byte order mark (as some editors write
    one) is not part of its value."""
    the, a = what
    if value is not None and path is not None:
        raise ValueError(f"give {option} or {file_option}, not both")
    if value is not None:
        return value, option
    if path is not None:
        where = f"{file_option} {path!r}"
        try:
            with open(path, encoding="utf-8-sig") as file:
                text = file.read(MAX_GIVEN_FILE + 1)
        except (OSError, UnicodeDecodeError) as exc:
            reason = (
                exc.strerror or type(exc).__name__
                if isinstance(exc, OSError)
                else "it is not UTF-8 text"
            )
            raise ValueError(f"{where}: cannot read it ({reason})") from None
        if len(text) > MAX_GIVEN_FILE:
            raise ValueError(
                f"{where} holds over {MAX_GIVEN_FILE:,} characters, more than {a}; "
                f"put {the} alone in it"
            )
        return _one_line(text, where, f"{where} is empty; put {the} in it", the), file_option
    given = None if variable is None else os.environ.get(variable)
    if variable is None or given is None:
        return None
    empty = f"{variable} is set but empty; give it {a}, or unset it"
    return _one_line(given, variable, empty, the), variable


def _one_line(text: str, where: str, empty: str, the: str) -> str:
    """``text`` without its surrounding whitespace, refused with ``empty`` if that leaves
    nothing, and if it holds more than one line (``where`` names it; what it holds is
    never shown: a password)."""
    value = text.strip()
    if not value:
        raise ValueError(empty)
    if len(value.splitlines()) > 1:
        raise ValueError(f"{where} holds more than one line; give {the} alone, on one line")
    return value
