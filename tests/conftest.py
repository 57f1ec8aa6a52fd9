"""Shared fixtures."""

from __future__ import annotations

import pytest

import sessionactors as sa
from sessionactors.testing import EchoModel


@pytest.fixture
def echo_agents() -> dict[str, sa.Agent]:
    """One agent, "echo", whose model streams the user's words back."""
    return {"echo": sa.Agent(model=EchoModel())}
