"""Binary and double binary trees, and their reduce-then-broadcast steps.

The shape follows NCCL's ``ncclGetBtree`` / ``ncclGetDtree``; the two-tree idea is Sanders,
Speck & Träff, "Two-tree algorithms for full bandwidth broadcast, reduction and scan",
Parallel Computing 35(12), 2009.
"""

from __future__ import annotations

from fedagg.collectives.transfer import Op, Transfer

__all__ = ["binary_tree", "double_binary_tree", "merge_steps", "tree_steps"]


def binary_tree(size: int) -> list[int]:
    """Parents of an in-order binary tree over ``0..size-1`` rooted at 0 (NCCL ``ncclGetBtree``).

    Rank 0 is the root with a single child, the largest power of two below ``size``; below it
    a node with lowest set bit ``b`` has children ``v - b/2`` and ``v + b/2`` (descending the
    right spine while out of range). Odd ranks are leaves, even ranks are interior.

    Returns
    -------
    list of int
        ``parent[v]``, ``-1`` for the root.
    """
    parent = [-1] * size
    if size <= 1:
        return parent
    top = 1 << (size - 1).bit_length() - 1
    parent[top] = 0
    stack = [top]
    while stack:
        v = stack.pop()
        b = v & -v
        half = b >> 1
        if half == 0:
            continue
        left = v - half
        parent[left] = v
        stack.append(left)
        step = half
        while step and v + step >= size:
            step >>= 1
        if step:
            parent[v + step] = v
            stack.append(v + step)
    return parent


def double_binary_tree(size: int) -> tuple[list[int], list[int]]:
    """Parents in the two trees of a double binary tree (Sanders, Speck & Träff 2009).

    The second tree mirrors the first (``v -> size - 1 - v``) when ``size`` is even and shifts
    it by one rank when ``size`` is odd, so that most ranks are a leaf in one of the trees.
    """
    first = binary_tree(size)
    if size % 2 == 0:
        perm = [size - 1 - v for v in range(size)]
    else:
        perm = [(v + 1) % size for v in range(size)]
    second = [-1] * size
    for v, p in enumerate(first):
        second[perm[v]] = -1 if p < 0 else perm[p]
    return first, second


def tree_steps(
    parent: list[int], members: list[int], chunks: list[int], start: int
) -> dict[int, list[Transfer]]:
    """Reduce to the root then broadcast, over ``members`` (tree positions -> ranks)."""
    size = len(parent)
    children: list[list[int]] = [[] for _ in range(size)]
    for v, p in enumerate(parent):
        if p >= 0:
            children[p].append(v)
    height = [0] * size
    depth = [0] * size
    order: list[int] = [v for v in range(size) if parent[v] < 0]
    for v in order:  # breadth-first; the list grows while iterating
        for c in children[v]:
            depth[c] = depth[v] + 1
            order.append(c)
    for v in reversed(order):
        height[v] = max((height[c] + 1 for c in children[v]), default=0)
    root_height = max((height[v] for v in range(size) if parent[v] < 0), default=0)
    out: dict[int, list[Transfer]] = {}
    for v in range(size):
        p = parent[v]
        if p < 0:
            continue
        up = start + height[v]
        down = start + root_height + depth[v] - 1
        for c in chunks:
            out.setdefault(up, []).append(Transfer(members[v], members[p], c, Op.REDUCE))
            out.setdefault(down, []).append(Transfer(members[p], members[v], c, Op.COPY))
    return out


def merge_steps(parts: list[dict[int, list[Transfer]]]) -> list[tuple[Transfer, ...]]:
    keys = sorted({k for p in parts for k in p})
    steps: list[tuple[Transfer, ...]] = []
    for k in keys:
        step: list[Transfer] = []
        for p in parts:
            step.extend(p.get(k, []))
        steps.append(tuple(step))
    return steps
