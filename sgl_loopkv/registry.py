"""A string-keyed registry: components are chosen by name (CLI flag -> factory), never by if/elif."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str, hint: str = ""):
        self.kind = kind
        self.hint = hint  # where names registered from outside the package come from (for the error)
        self._factories: dict[str, Callable[..., T]] = {}

    def register(self, name: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
        def decorator(factory: Callable[..., T]) -> Callable[..., T]:
            if name in self._factories and self._factories[name] is not factory:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._factories[name] = factory
            return factory

        return decorator

    def create(self, name: str, *args, **kwargs) -> T:
        if name not in self._factories:
            raise KeyError(self.unknown(name))
        return self._factories[name](*args, **kwargs)

    def unknown(self, name: str) -> str:
        """The error for a name nothing registered."""
        return f"unknown {self.kind} {name!r}; choose one of {self.names()}" + (f" ({self.hint})" if self.hint else "")

    def names(self) -> list[str]:
        return sorted(self._factories)

    def __contains__(self, name: str) -> bool:
        return name in self._factories
