"""Export documents made from a state, to test what imports them."""

from __future__ import annotations

import datetime
from typing import Any

from .._export import dump_export
from .._records import SessionState

__all__ = ["export_document"]


def export_document(
    state: SessionState, *, exported_at: datetime.datetime | None = None
) -> dict[str, Any]:
    """The document ``python -m sessionactors sessions export`` writes for ``state``
    (JSON-ready: ``json.dumps`` it), made from a state you build: to test your import
    tooling, or that ``sessions import`` refuses what you could be sent (a state no
    session can reach, such as a history that breaks the history rules)."""
    when = exported_at or datetime.datetime.now(datetime.UTC)
    return dump_export(state, exported_at=when)
