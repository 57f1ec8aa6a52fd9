"""Classes that users cannot construct: the library makes them.

As trio's ``MemorySendChannel`` is made only by ``open_memory_channel``, a
``Registry`` is made only by ``open_registry``, a ``SessionRef`` by the
registry and a ``Turn`` by ``submit``. Calling the class raises ``TypeError``
that says where to get one; the library calls ``_create``.
"""

from typing import Any, NoReturn, TypeVar

__all__ = ["NoPublicConstructor"]

T = TypeVar("T")


class NoPublicConstructor(type):
    """Metaclass: ``Cls(...)`` raises ``TypeError``; the library uses ``Cls._create(...)``."""

    def __call__(cls, *args: object, **kwargs: object) -> NoReturn:
        raise TypeError(
            f"sessionactors.{cls.__name__} has no public constructor; "
            f"{getattr(cls, '_made_by', 'the library makes it')}"
        )

    def _create(cls: type[T], *args: Any, **kwargs: Any) -> T:
        return super().__call__(*args, **kwargs)  # type: ignore[misc, no-any-return]
