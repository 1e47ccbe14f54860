"""Shared by the experiment scripts: a hand-written N = 2 ring on ProcessGroup send / recv."""

from __future__ import annotations

from typing import Any

import torch


class HandRing:
    """Sum ``x`` (``nbytes`` of float32) across two ranks, ``nseg`` segments per chunk."""

    def __init__(self, rank: int, nbytes: int, nseg: int) -> None:
        self.p = 1 - rank
        self.nseg = nseg
        h = nbytes // 8
        self.x = torch.ones(2 * h)
        sc = torch.empty(h)
        seg = h // nseg
        self.mine = [slice(rank * h + k * seg, rank * h + (k + 1) * seg) for k in range(nseg)]
        self.other = [
            slice((1 - rank) * h + k * seg, (1 - rank) * h + (k + 1) * seg) for k in range(nseg)
        ]
        self.scs = [sc[k * seg : (k + 1) * seg] for k in range(nseg)]

    def eager(self, send_pg: Any, recv_pg: Any) -> None:
        """Every receive posted before the first send; a wavefront over the segments."""
        p, x, n = self.p, self.x, self.nseg
        r1 = [recv_pg.recv([self.scs[k]], p, 0) for k in range(n)]
        r2 = [recv_pg.recv([x[self.other[k]]], p, 0) for k in range(n)]
        s = [send_pg.send([x[self.other[k]]], p, 0) for k in range(n)]
        for k in range(n):
            r1[k].wait()
            x[self.mine[k]].add_(self.scs[k])
            s.append(send_pg.send([x[self.mine[k]]], p, 0))
        for w in r2 + s:
            w.wait()

    def lazy(self, pg: Any) -> None:
        """Each receive posted right before it is waited on."""
        p, x, n = self.p, self.x, self.nseg
        s = [pg.send([x[self.other[k]]], p, 0) for k in range(n)]
        for k in range(n):
            pg.recv([self.scs[k]], p, 0).wait()
            x[self.mine[k]].add_(self.scs[k])
            s.append(pg.send([x[self.mine[k]]], p, 0))
        for k in range(n):
            pg.recv([x[self.other[k]]], p, 0).wait()
        for w in s:
            w.wait()
