"""Name → class registries for compressors, fusion planners and communicators.

Users extend the plugin by decorating a subclass (``@register_compressor("mine")``) rather than by
editing an if/elif chain (unlike GRACE); every lookup error names the bad value and the known ones.
"""
from __future__ import annotations

from typing import Callable, Generic, Sequence, TypeVar

T = TypeVar("T", bound=type)


class Registry(Generic[T]):
    """Classes registered by name for one option of ``DistributedOptimizer``.

    Args:
        option: the option's name in messages (``compressor``, ``fusion``, ``communicator``).
        plural: what the known names are called (``compressors``, ``fusion planners``, ...).
        base: the class every registered class must derive from.
    """

    def __init__(self, option: str, plural: str, base: type) -> None:
        self.option, self.plural, self.base = option, plural, base
        self._classes: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Class decorator: make a subclass of ``base`` selectable by ``name``."""
        def wrap(cls: T) -> T:
            if not (isinstance(cls, type) and issubclass(cls, self.base)):
                raise TypeError(f"registering {self.option} {name!r} needs a {self.base.__name__} subclass, got {cls!r}")
            if name in self._classes and self._classes[name] is not cls:
                raise ValueError(f"{self.option} name {name!r} is already registered by "
                                 f"{self._classes[name].__name__}")
            cls.name = name
            self._classes[name] = cls
            return cls
        return wrap

    def names(self) -> list[str]:
        return sorted(self._classes)

    def items(self) -> list[tuple[str, T]]:
        return sorted(self._classes.items())

    def get(self, spec: object, also: Sequence[str] = ()) -> T:
        """The class registered as ``spec``, or a ``ValueError`` listing ``also`` and the known names."""
        if isinstance(spec, str) and spec in self._classes:
            return self._classes[spec]
        raise ValueError(f"unknown {self.option} {spec!r}; known {self.plural}: "
                         f"{', '.join([*also, *self.names()])} (or pass a {self.base.__name__} instance)")
