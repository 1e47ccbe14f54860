"""Bucket layout of :class:`clients.buckets.GradReducer`: buckets, assignment, agreement.

What DDP's ``Reducer`` does around the all-reduce itself (Li et al. 2020, "PyTorch
Distributed: Experiences on Accelerating Data Parallel Training", VLDB, section 3.2.3
"Gradient Bucketing" and section 4.2 "Reducer"), as small functions over plain tensors:

* :func:`assign_buckets` groups parameters, in a given order, into buckets of about
  ``bucket_bytes`` (the first one capped at ``first_bucket_bytes``, DDP's
  ``_DEFAULT_FIRST_BUCKET_BYTES`` = 1 MiB, so the first all-reduce starts early in backward);
  a bucket never mixes dtypes or devices.
* :class:`Bucket` owns one flat buffer per bucket and, for every dense contiguous parameter,
  a view of its slice shaped like the parameter. ``param.grad`` *is* that view once the
  reducer attached it (DDP ``gradient_as_bucket_view=True``): autograd accumulates into the
  bucket and the all-reduce result is the gradient, with no copy in and none out.
* :func:`agree_order` makes every worker adopt the same observed gradient-ready order before
  the layout is rebuilt from it (DDP ``rebuild_buckets`` uses rank 0's order, section 3.2.3:
  "all processes must use the same bucketing order").
* :func:`broadcast_` copies worker 0's tensors to every worker (DDP ``broadcast_buffers``).

All collectives here go through :func:`fedagg.collectives.all_reduce` on the site's
communicator, so the in-process and torch.distributed transports behave alike.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
from torch import nn

from fedagg.collectives import Communicator, all_reduce

__all__ = ["DEFAULT_FIRST_BUCKET_BYTES", "Bucket", "agree_order", "assign_buckets", "broadcast_"]

DEFAULT_FIRST_BUCKET_BYTES = 1 << 20
"""DDP's ``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`` (1 MiB)."""


def assign_buckets(
    order: Sequence[int],
    params: Sequence[nn.Parameter],
    bucket_bytes: int,
    first_bucket_bytes: int,
) -> list[list[int]]:
    """Greedy buckets of parameter indices, in ``order``.

    A parameter joins the current bucket while the bucket stays within its cap (the first
    bucket's cap is ``min(first_bucket_bytes, bucket_bytes)``, the others ``bucket_bytes``),
    else it starts a new bucket; a parameter larger than the cap gets a bucket of its own. A
    change of dtype or device also starts a new bucket (one flat buffer per bucket).

    Parameters
    ----------
    order : sequence of int
        Indices into ``params``, in the order their gradients are expected to be ready.
    params : sequence of torch.nn.Parameter
        The reducer's parameters.
    bucket_bytes, first_bucket_bytes : int
        Caps in bytes.
    """
    groups: list[list[int]] = []
    size = 0
    key: tuple[torch.dtype, torch.device] | None = None
    for i in order:
        p = params[i]
        nbytes = p.numel() * p.element_size()
        cap = min(first_bucket_bytes, bucket_bytes) if len(groups) <= 1 else bucket_bytes
        if groups and key == (p.dtype, p.device) and size + nbytes <= cap:
            groups[-1].append(i)
            size += nbytes
        else:
            groups.append([i])
            size = nbytes
            key = (p.dtype, p.device)
    return groups


class Bucket:
    """One bucket: a flat buffer holding its parameters' gradients back to back.

    Parameters
    ----------
    index : int
        Position in the reduction order (every worker reduces bucket 0 first).
    params : list of int
        Indices of the reducer's parameters in this bucket, in buffer order.
    tensors : sequence of torch.nn.Parameter
        All of the reducer's parameters (indexed by ``params``).
    views : bool
        Build :attr:`views` (gradient-as-bucket-view) for dense contiguous parameters.
    """

    def __init__(
        self, index: int, params: list[int], tensors: Sequence[nn.Parameter], views: bool
    ) -> None:
        self.index = index
        self.params = params
        members = [tensors[i] for i in params]
        self.offsets: list[int] = []
        total = 0
        for p in members:
            self.offsets.append(total)
            total += p.numel()
        first = members[0]
        self.flat = torch.zeros(total, dtype=first.dtype, device=first.device)
        self.views: list[torch.Tensor | None] = [
            self.flat.narrow(0, off, p.numel()).view_as(p)
            if views and p.layout == torch.strided and p.is_contiguous()
            else None
            for p, off in zip(members, self.offsets, strict=True)
        ]
        self.pending = len(params)
        self.ready = threading.Event()
        self.done = threading.Event()
        self.event: torch.cuda.Event | None = None

    def region(self, k: int, numel: int) -> torch.Tensor:
        """The flat slice of member ``k`` (``numel`` elements)."""
        return self.flat.narrow(0, self.offsets[k], numel)

    def holds(self, k: int, grad: torch.Tensor) -> bool:
        """Whether ``grad`` is member ``k``'s view of this bucket (no copy needed)."""
        view = self.views[k]
        if view is None:
            return False
        return grad is view or (
            grad.data_ptr() == view.data_ptr()
            and grad.shape == view.shape
            and grad.stride() == view.stride()
        )

    def reset(self) -> None:
        """Clear the per-step flags (before a step's first micro-batch)."""
        self.pending = len(self.params)
        self.ready.clear()
        self.done.clear()
        self.event = None


def agree_order(
    comm: Communicator,
    observed: Sequence[int],
    num_params: int,
    device: torch.device | None = None,
) -> list[int] | None:
    """The gradient-ready order of the lowest worker that observed one, on every worker.

    Every worker must call it at the same point. Each worker contributes one row
    ``[flag, i_0 + 1, i_1 + 1, ...]`` (zeros elsewhere) to a sum all-reduce in float64
    (parameter indices are exact there); every worker then reads the same row, so all of them
    rebuild the same layout -- even when a worker saw no data in the first step and observed
    nothing. Parameters missing from the order (unused in that step) are left to the caller.
    ``device`` is where the table lives (the gradients' device: NCCL reduces GPU tensors only).

    Returns
    -------
    list of int or None
        The agreed order, or ``None`` when no worker observed any gradient.
    """
    n, width = comm.world_size, num_params + 1
    table = torch.zeros(n * width, dtype=torch.float64, device=device)
    if observed:
        row = table.narrow(0, comm.rank * width, width)
        row[0] = 1.0
        row[1 : 1 + len(observed)] = torch.tensor(observed, dtype=torch.float64) + 1.0
    if n > 1:
        all_reduce(table, algorithm="native", op="sum", comm=comm)
    rows = table.view(n, width).tolist()
    for row in rows:
        if row[0] == 1.0:
            return [int(v) - 1 for v in row[1:] if v > 0]
    return None


def broadcast_(comm: Communicator, tensors: Sequence[torch.Tensor]) -> None:
    """Overwrite ``tensors`` on every worker with worker 0's values (in place).

    One sum all-reduce of a float64 buffer that only worker 0 fills (float64 holds float32
    values and integer counters such as BatchNorm's ``num_batches_tracked`` exactly).
    """
    if comm.world_size == 1 or not tensors:
        return
    sizes = [t.numel() for t in tensors]
    device = tensors[0].device
    if comm.rank == 0:
        flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors])
    else:
        flat = torch.zeros(sum(sizes), dtype=torch.float64, device=device)
    all_reduce(flat, algorithm="native", op="sum", comm=comm)
    offset = 0
    with torch.no_grad():
        for t, numel in zip(tensors, sizes, strict=True):
            t.copy_(flat.narrow(0, offset, numel).view_as(t))
            offset += numel
