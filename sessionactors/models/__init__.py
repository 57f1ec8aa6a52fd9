"""Real model adapters. ``OpenAIChatModel`` needs the ``openai`` extra (httpx)."""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._openai import OpenAIChatModel as OpenAIChatModel

__all__ = ["OpenAIChatModel"]


def __getattr__(name: str) -> Any:
    if name == "OpenAIChatModel":
        from ._openai import OpenAIChatModel

        return OpenAIChatModel
    raise AttributeError(f"module 'sessionactors.models' has no attribute {name!r}")
