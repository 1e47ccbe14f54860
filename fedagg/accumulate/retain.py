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

Updates of at least ``spill_bytes`` are written to a private temporary directory (``.npy``
files, read back memory-mapped), smaller ones are copied in memory, so keeping them costs
disk rather than memory for big models. Updates arriving in increasing order of weight or
norm (sites with more data finishing later) are the worst case: each one displaces a kept
one, one write per update.
"""

from __future__ import annotations

import math
import shutil
import tempfile
from collections.abc import Sequence
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


def _score(value: float) -> float:
    return math.inf if not math.isfinite(value) else float(value)


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
        self._kept: dict[str, list[Any] | Path] = {}
        self.writes = 0
        """Updates written to disk so far."""

    def __contains__(self, key: object) -> bool:
        return key in self._kept

    def __len__(self) -> int:
        return len(self._kept)

    def offer(self, key: str, weight: float, norm: float,
              update: Sequence[TensorUpdate]) -> None:
        """Keep ``update`` if it is among the top ``keep`` by norm or by weight so far."""
        if self.keep == 0:
            return
        entry_n, entry_w = (_score(norm), key), (_score(weight), key)
        top_n = sorted([*self._by_norm, entry_n], reverse=True)[:self.keep]
        top_w = sorted([*self._by_weight, entry_w], reverse=True)[:self.keep]
        if entry_n not in top_n and entry_w not in top_w:
            return
        self._by_norm, self._by_weight = top_n, top_w
        self._store(key, update)
        wanted = {k for _, k in top_n} | {k for _, k in top_w}
        for k in [k for k in self._kept if k not in wanted]:
            self._drop(k)

    def get(self, key: str) -> list[TensorUpdate] | None:
        """The kept update of ``key`` (memory-mapped when on disk), or None."""
        item = self._kept.get(key)
        if item is None:
            return None
        if isinstance(item, Path):
            out: list[TensorUpdate] = []
            for j, kind in enumerate(np.load(item / "kinds.npy").tolist()):
                if kind:
                    out.append(Sparse(np.load(item / f"{j}.idx.npy", mmap_mode="r"),
                                      np.load(item / f"{j}.val.npy", mmap_mode="r")))
                else:
                    out.append(np.load(item / f"{j}.npy", mmap_mode="r"))
            return out
        return list(item)

    def _store(self, key: str, update: Sequence[TensorUpdate]) -> None:
        if _nbytes(update) < self.spill_bytes:
            self._kept[key] = [Sparse(np.array(u.indices), np.array(u.values))
                               if isinstance(u, Sparse) else np.array(u) for u in update]
            return
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="fedagg-retain-", dir=self._root))
        where = self._dir / f"u{self.writes}"
        where.mkdir()
        kinds = []
        for j, u in enumerate(update):
            if isinstance(u, Sparse):
                np.save(where / f"{j}.idx.npy", np.asarray(u.indices), allow_pickle=False)
                np.save(where / f"{j}.val.npy", np.asarray(u.values), allow_pickle=False)
                kinds.append(1)
            else:
                np.save(where / f"{j}.npy", np.asarray(u), allow_pickle=False)
                kinds.append(0)
        np.save(where / "kinds.npy", np.asarray(kinds, np.int8), allow_pickle=False)
        self.writes += 1
        self._kept[key] = where

    def _drop(self, key: str) -> None:
        item = self._kept.pop(key)
        if isinstance(item, Path):
            shutil.rmtree(item, ignore_errors=True)

    def close(self) -> None:
        """Forget everything and delete the temporary directory."""
        self._kept.clear()
        self._by_norm, self._by_weight = [], []
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> Retainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
