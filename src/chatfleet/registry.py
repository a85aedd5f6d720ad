"""One small generic registry for named implementations of a policy point.

Eviction policies, scheduling policies (and later routing, admission, ...) register a factory
under a name; configs carry the name; ``make`` builds one and an unknown name fails with a
``ConfigError`` that lists the valid ones::

    EVICTION = Registry[EvictionPolicy]("eviction policy")

    @EVICTION.register("lru")
    class LRUEviction: ...

    policy = EVICTION.make("lru", clock=time.monotonic)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from chatfleet.errors import ConfigError

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., object])


class Registry(Generic[T]):
    """Factories of ``T`` by name (``kind`` names the policy point in error messages)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._factories: dict[str, Callable[..., T]] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator: register a class or function under ``name`` (names are unique)."""

        def add(factory: F) -> F:
            if name in self._factories:
                raise ConfigError(f"{self.kind} {name!r} is registered twice")
            self._factories[name] = factory  # type: ignore[assignment]
            return factory

        return add

    def check(self, name: str) -> str:
        """``name`` if registered, else a ConfigError listing the valid names."""
        if name not in self._factories:
            raise ConfigError(f"unknown {self.kind} {name!r}; valid: {', '.join(self.names)}")
        return name

    def make(self, name: str, /, *args: object, **kwargs: object) -> T:
        return self._factories[self.check(name)](*args, **kwargs)

    @property
    def names(self) -> list[str]:
        return sorted(self._factories)

    def __contains__(self, name: object) -> bool:
        return name in self._factories
