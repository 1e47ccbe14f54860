"""The few updates a whole-round check may still have to correct, kept aside (bounded).

A streamed round folds every update as it arrives; the median-relative guards decide only
when the round is closed (:class:`~fedagg.accumulate.RoundStatistics`). An update they refuse
(a norm above ``factor`` x the median) or cap (a weight above ``ratio`` x the median) is then
corrected exactly in the integer accumulator — folded again with ``-w``, and with the capped
weight — which needs the update once more. The refused ones are the largest norms and the
capped ones the largest weights, so :class:`Retainer` keeps, at any time, the ``keep`` updates
with the largest norms and the ``keep`` with the largest weights seen so far (ties broken by
site, so the kept set does not depend on the arrival order): at most ``2 keep`` updates,
whatever the number of sites. A round that needs more corrections than were kept cannot be
corrected; the caller refuses it (the global model is unchanged) and says so.

Updates of at least ``spill_bytes`` are written to a private temporary directory, smaller ones
are kept in memory (a read-only view on a reply's ``bytes`` as it is, anything else copied), so
keeping them costs disk rather than memory for big models. The
directory holds at most ``2 keep`` files ("slots"), written over in place when a kept update
is displaced (one ``pwrite`` per tensor into pages the kernel already holds — no file created,
truncated or unlinked per update, and at most ``2 keep`` updates' worth of dirty pages), and
read back memory-mapped. Updates arriving in increasing order of weight or norm (sites with
more data finishing later) are the worst case: each one displaces a kept one, one write per
update; :class:`strategies.streaming.StreamRound` offers only the updates a whole-round
decision could still touch.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedagg.accumulate.grid import Sparse, TensorUpdate
from fedagg.errors import ConfigError, explain

__all__ = ["DEFAULT_SPILL_BYTES", "Retainer"]

DEFAULT_SPILL_BYTES = 16 << 20
"""Updates of at least this many bytes are kept on disk rather than in memory."""


def _nbytes(update: Sequence[TensorUpdate]) -> int:
    return sum(int(u.indices.nbytes + np.asarray(u.values).nbytes) if isinstance(u, Sparse)
               else int(np.asarray(u).nbytes) for u in update)


def _frozen(a: Any) -> np.ndarray:
    """``a`` itself when nobody can change its values (a read-only view on a ``bytes`` object,
    as the arrays of a received reply are), else a copy."""
    arr = np.asarray(a)
    base: Any = arr
    while isinstance(base, np.ndarray):
        if base.flags.writeable:
            return np.array(arr)
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj if base.readonly else None
    return arr if isinstance(base, bytes) else np.array(arr)


def _score(value: float) -> float:
    return math.inf if not math.isfinite(value) else float(value)


@dataclass(frozen=True)
class _Part:
    """One array of a kept update inside its slot file: where its bytes start, its type."""

    offset: int
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class _OnDisk:
    """A kept update in slot file ``path``: per tensor ``(part,)`` or ``(indices, values)``."""

    path: Path
    tensors: tuple[tuple[_Part, ...], ...]


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset`` (a single write stops at ~2 GiB on Linux)."""
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


def _read(path: Path, part: _Part) -> np.ndarray:
    """``part`` of slot file ``path``, memory-mapped read-only (an empty array in memory)."""
    if math.prod(part.shape) == 0:
        out = np.empty(part.shape, np.dtype(part.dtype))
        out.flags.writeable = False
        return out
    return np.memmap(path, dtype=np.dtype(part.dtype), mode="r", offset=part.offset,
                     shape=part.shape)


class Retainer:
    """Keep the top-``keep`` updates by norm and by weight of one round.

    Parameters
    ----------
    keep : int
        Updates kept per criterion (0: none; every correction is then impossible).
    spill_bytes : int
        Updates at least this large go to disk.
    directory : path, optional
        Where the temporary directory is made (default: the system's).
    """

    def __init__(self, keep: int = 2, *, spill_bytes: int = DEFAULT_SPILL_BYTES,
                 directory: str | Path | None = None) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
            raise ConfigError(explain("keep", keep, "must be an int >= 0",
                                      "keep e.g. 2 updates per criterion"))
        self.keep = keep
        self.spill_bytes = spill_bytes
        self._root = directory
        self._dir: Path | None = None
        self._by_norm: list[tuple[float, str]] = []
        self._by_weight: list[tuple[float, str]] = []
        self._kept: dict[str, list[Any] | _OnDisk] = {}
        self._free: list[Path] = []
        """Slot files whose update was dropped: written over by the next one kept on disk."""
        self._slots = 0
        self.writes = 0
        """Updates written to disk so far."""

    def __contains__(self, key: object) -> bool:
        return key in self._kept

    def __len__(self) -> int:
        return len(self._kept)

    def _tops(self, key: str, weight: float, norm: float
              ) -> tuple[list[tuple[float, str]], list[tuple[float, str]], bool]:
        entry_n, entry_w = (_score(norm), key), (_score(weight), key)
        top_n = sorted([*self._by_norm, entry_n], reverse=True)[:self.keep]
        top_w = sorted([*self._by_weight, entry_w], reverse=True)[:self.keep]
        return top_n, top_w, entry_n in top_n or entry_w in top_w

    def would_keep(self, key: str, weight: float, norm: float) -> bool:
        """Whether :meth:`offer` would keep an update with this weight and norm now."""
        return self.keep > 0 and self._tops(key, weight, norm)[2]

    def offer(self, key: str, weight: float, norm: float,
              update: Sequence[TensorUpdate]) -> None:
        """Keep ``update`` if it is among the top ``keep`` by norm or by weight so far."""
        if self.keep == 0:
            return
        top_n, top_w, kept = self._tops(key, weight, norm)
        if not kept:
            return
        self._by_norm, self._by_weight = top_n, top_w
        wanted = {k for _, k in top_n} | {k for _, k in top_w}
        for k in [k for k in self._kept if k not in wanted]:
            self._drop(k)  # first, so that the new update can reuse the slot
        self._store(key, update)

    def get(self, key: str) -> list[TensorUpdate] | None:
        """The kept update of ``key`` (memory-mapped when on disk), or None.

        The arrays stay valid until the next :meth:`offer` (which may write over the slot).
        """
        item = self._kept.get(key)
        if item is None:
            return None
        if isinstance(item, _OnDisk):
            return [Sparse(_read(item.path, t[0]), _read(item.path, t[1])) if len(t) == 2
                    else _read(item.path, t[0]) for t in item.tensors]
        return list(item)

    def _store(self, key: str, update: Sequence[TensorUpdate]) -> None:
        if _nbytes(update) < self.spill_bytes:
            self._kept[key] = [Sparse(_frozen(u.indices), _frozen(u.values))
                               if isinstance(u, Sparse) else _frozen(u) for u in update]
            return
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="fedagg-retain-", dir=self._root))
        if self._free:
            path = self._free.pop()
        else:
            path = self._dir / f"slot{self._slots}"
            self._slots += 1
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        offset = 0
        tensors: list[tuple[_Part, ...]] = []
        try:
            for u in update:
                parts = []
                for a in ((u.indices, u.values) if isinstance(u, Sparse) else (u,)):
                    arr = np.ascontiguousarray(a)
                    parts.append(_Part(offset, arr.dtype.str, tuple(arr.shape)))
                    if arr.nbytes:
                        _pwrite_all(fd, arr.reshape(-1).view(np.uint8).data, offset)
                    offset += arr.nbytes
                tensors.append(tuple(parts))
        except BaseException:
            self._free.append(path)
            raise
        finally:
            os.close(fd)
        self.writes += 1
        self._kept[key] = _OnDisk(path, tuple(tensors))

    def _drop(self, key: str) -> None:
        item = self._kept.pop(key)
        if isinstance(item, _OnDisk):
            self._free.append(item.path)

    def close(self) -> None:
        """Forget everything and delete the temporary directory."""
        self._kept.clear()
        self._free.clear()
        self._slots = 0
        self._by_norm, self._by_weight = [], []
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> Retainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
