"""A small name -> factory registry with entry-point discovery.

Built-in components register themselves by name; third-party packages publish theirs through
an entry-point group (``fedagg.strategies``, ``fedagg.compressors``) in their distribution
metadata, and are discovered lazily the first time a name is looked up. An unknown name raises
:class:`~fedagg.errors.RegistryError` naming the closest known names and listing every one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from importlib.metadata import EntryPoint, entry_points
from typing import Generic, TypeVar

from fedagg.errors import RegistryError, did_you_mean, explain

__all__ = ["Registry"]

_log = logging.getLogger(__name__)

T = TypeVar("T")


class Registry(Generic[T]):
    """Names mapped to objects (usually factories), plus an entry-point group.

    Parameters
    ----------
    kind : str
        What the registry holds, for messages (``"strategy"``).
    group : str or None
        Entry-point group scanned for third-party registrations, or ``None``.

    Examples
    --------
    >>> reg: Registry[int] = Registry("number")
    >>> reg.register("one", 1)
    1
    >>> reg.get("one")
    1
    """

    def __init__(self, kind: str, group: str | None = None) -> None:
        self.kind = kind
        self.group = group
        self._items: dict[str, T] = {}
        self._origins: dict[str, str] = {}
        self._discovered = False

    def register(self, name: str, obj: T, *, origin: str = "built-in", replace: bool = False) -> T:
        """Register ``obj`` under ``name`` and return it (usable as a decorator helper)."""
        key = self._normalize(name)
        if key in self._items and not replace:
            raise RegistryError(
                explain(
                    f"{self.kind} name",
                    name,
                    f"is already registered (by {self._origins[key]})",
                    "choose another name, or pass replace=True to override on purpose",
                )
            )
        self._items[key] = obj
        self._origins[key] = origin
        return obj

    def decorator(self, name: str) -> Callable[[T], T]:
        """Return a decorator that registers its target under ``name``."""

        def wrap(obj: T) -> T:
            return self.register(name, obj)

        return wrap

    def get(self, name: str) -> T:
        """Look ``name`` up, discovering entry points on the first miss."""
        key = self._normalize(name)
        if key not in self._items:
            self.discover()
        if key not in self._items:
            known = ", ".join(sorted(self._items)) or "(none)"
            hint = did_you_mean(key, self._items)
            raise RegistryError(
                explain(
                    self.kind,
                    name,
                    f"is not a known {self.kind}{hint}; known: {known}",
                    f"use one of the known names, or install a plugin that registers it in "
                    f"the entry-point group {self.group!r}",
                )
            )
        return self._items[key]

    def origin(self, name: str) -> str:
        """Where ``name`` came from: ``"built-in"`` or ``"entry point <dist>:<value>"``."""
        self.get(name)
        return self._origins[self._normalize(name)]

    def names(self) -> list[str]:
        """All known names (after entry-point discovery), sorted."""
        self.discover()
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        self.discover()
        return self._normalize(name) in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def discover(self, *, force: bool = False) -> None:
        """Load the entry points of :attr:`group` (once, or again with ``force``)."""
        if self.group is None or (self._discovered and not force):
            return
        self._discovered = True
        for ep in _entry_points(self.group):
            key = self._normalize(ep.name)
            if key in self._items and self._origins[key] == "built-in":
                _log.warning(
                    "entry point %r in group %r shadows a built-in %s; ignoring it",
                    ep.name,
                    self.group,
                    self.kind,
                )
                continue
            try:
                obj = ep.load()
            except Exception as exc:  # a broken plugin must not break the registry
                _log.warning(
                    "could not load %s plugin %r (%s): %s", self.kind, ep.name, ep.value, exc
                )
                continue
            dist = getattr(getattr(ep, "dist", None), "name", "?")
            self._items[key] = obj
            self._origins[key] = f"entry point {dist}:{ep.value}"

    @staticmethod
    def _normalize(name: str) -> str:
        return name.strip().lower().replace("_", "-")


def _entry_points(group: str) -> list[EntryPoint]:
    return list(entry_points(group=group))
