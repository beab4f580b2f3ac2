"""Per-segment compressor state (thresholds, ratios, estimation steps) as arrays per buffer layout.

Threshold compressors keep a number per tensor across steps — SAFusion §4 reuses a threshold for
several iterations, ExDyna's Algorithm 5 scales it, RedSync starts its bisection from the last
ratio. Decisions over all segments at once are array operations, so the numbers of one buffer's
segments live in one NumPy array, in the buffer's segment order; a mapping by segment name on top
keeps them when the fusion plan changes and lets users and tests read them.
"""
from __future__ import annotations

from collections.abc import Iterator, MutableMapping

import numpy as np
import torch


class PerSegment(MutableMapping):
    """A float per segment name, stored as one array per layout (a :class:`Segments`' names).

    :meth:`of` returns the array of a layout — modified in place by the compressor; :meth:`on`
    returns it as a tensor on a device instead (the device path, which must not read it back). A layout seen
    for the first time takes the values its names had in earlier layouts (``fill`` for new names)
    and a layout none of whose names is left in it is dropped. Reading and assigning by name (``state["conv1.weight"]``) work as
    for a dict; a name is in the mapping once it has a value other than NaN.
    """

    def __init__(self, fill: float = np.nan) -> None:
        self.fill = float(fill)
        self._layouts: dict[tuple[str, ...], np.ndarray] = {}
        self._where: dict[str, tuple[tuple[str, ...], int]] = {}
        self._valued: dict[str, bool] = {}  # names the device path has written (known on the host)

    def of(self, names: tuple[str, ...]) -> np.ndarray:
        """The float64 array of the layout ``names`` (a live view: write to update the state)."""
        return self._layout(names, None)

    def on(self, names: tuple[str, ...], device: torch.device) -> torch.Tensor:
        """The layout ``names`` as a float64 tensor on ``device`` (a live view, like :meth:`of`)."""
        return self._layout(names, device)

    def unseen(self, names: tuple[str, ...]) -> bool:
        """Whether some of ``names`` has never been given a value by :meth:`mark` (host-side
        bookkeeping: the device path cannot look for NaN without reading the tensor back)."""
        valued = self.__dict__.setdefault("_valued", {})  # absent in checkpoints of older versions
        return not all(n in valued or self._on_host(n) for n in names)

    def _on_host(self, name: str) -> bool:
        """Whether ``name`` has a value in a host (NumPy) layout."""
        where = self._where.get(name)
        if where is None or isinstance(self._layouts[where[0]], torch.Tensor):
            return False
        return not np.isnan(self._layouts[where[0]][where[1]])

    def mark(self, names: tuple[str, ...]) -> None:
        """``names`` now hold values (written through :meth:`on`)."""
        marked = self.__dict__.setdefault("_marked", {})  # layouts marked already: every step marks
        if names not in marked:
            self.__dict__.setdefault("_valued", {}).update((n, True) for n in names)
            marked[names] = True

    def _layout(self, names: tuple[str, ...], device: torch.device | None):
        values = self._layouts.get(names)
        if values is not None and device is not None and not isinstance(values, torch.Tensor):
            values = self._layouts[names] = torch.from_numpy(values).to(device)
        if values is None:
            values = np.array([self._get(n, self.fill) for n in names], dtype=np.float64)
            if device is not None:
                values = torch.from_numpy(values).to(device)
            self._layouts[names] = values
            self._where.update((n, (names, i)) for i, n in enumerate(names))
            held = {layout for layout, _ in self._where.values()}  # a layout all of whose names moved goes
            self._layouts = {layout: v for layout, v in self._layouts.items() if layout in held}
        return values

    def _get(self, name: str, default: float) -> float:
        where = self._where.get(name)
        return default if where is None else float(self._layouts[where[0]][where[1]])

    def __getitem__(self, name: str) -> float:
        value = self._get(name, np.nan)
        if np.isnan(value):
            raise KeyError(name)
        return value

    def __setitem__(self, name: str, value: float) -> None:
        where = self._where.get(name)
        if where is None:
            self.of((name,))[0] = value
        else:
            self._layouts[where[0]][where[1]] = value

    def __delitem__(self, name: str) -> None:
        self[name]  # KeyError if absent
        self[name] = np.nan

    def __iter__(self) -> Iterator[str]:
        return (n for n in self._where if not np.isnan(self._get(n, np.nan)))

    def __len__(self) -> int:
        return sum(1 for _ in self)
