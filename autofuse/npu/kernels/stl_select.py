"""The order ``torch.topk`` gives equal values on the CPU: libstdc++'s selection algorithms, replayed.

torch 2.13's CPU ``topk`` (``aten/src/ATen/native/cpu/SortingKernel.cpp``, ``topk_impl_loop``) fills a
vector of ``(value, index)`` pairs in index order and, with the comparator ``a > b`` (NaN first; ``a < b``
for ``largest=False``, NaN last):

* when ``k * 64 <= n``: ``std::partial_sort(first, first + k, last)`` (heap select, then sort_heap);
* otherwise: ``std::nth_element(first, first + k - 1, last)`` (introselect) and, if ``sorted``,
  ``std::sort(first, first + k - 1)`` (introsort; the k-th element is already in place);

and returns the first k pairs. Neither algorithm is stable, so among equal values the result is *not*
lowest-index-first (``topk([1, 3, 3, 2, 3, 0], 2)`` gives indices ``[2, 4]``). Without ties the result is
the k largest values, largest first. This module replays those libstdc++ algorithms step for step on a
list of pairs (:func:`torch_topk`), so a kernel can reproduce torch's indices exactly where a row has ties.
It also counts the comparisons it makes (the work a Scalar unit would do).
"""
from __future__ import annotations

import math


class _Cmp:
    """The strict weak order of torch's topk (NaN counts as the largest value: first for ``largest``, last
    otherwise), counting its calls."""

    def __init__(self, largest: bool):
        self.largest = largest
        self.calls = 0

    def __call__(self, x, y) -> bool:
        self.calls += 1
        a, b = x[0], y[0]
        if self.largest:
            return (math.isnan(a) and not math.isnan(b)) or a > b
        return (not math.isnan(a) and math.isnan(b)) or a < b


def _insertion_sort(v, first, last, comp):
    for i in range(first + 1, last):
        val = v[i]
        if comp(val, v[first]):
            v[first + 1:i + 1] = v[first:i]
            v[first] = val
        else:
            _unguarded_linear_insert(v, i, comp)


def _unguarded_linear_insert(v, last, comp):
    val = v[last]
    nxt = last - 1
    while comp(val, v[nxt]):
        v[last] = v[nxt]
        last = nxt
        nxt -= 1
    v[last] = val


def _move_median_to_first(v, result, a, b, c, comp):
    if comp(v[a], v[b]):
        if comp(v[b], v[c]):
            v[result], v[b] = v[b], v[result]
        elif comp(v[a], v[c]):
            v[result], v[c] = v[c], v[result]
        else:
            v[result], v[a] = v[a], v[result]
    elif comp(v[a], v[c]):
        v[result], v[a] = v[a], v[result]
    elif comp(v[b], v[c]):
        v[result], v[c] = v[c], v[result]
    else:
        v[result], v[b] = v[b], v[result]


def _unguarded_partition(v, first, last, pivot, comp):
    while True:
        while comp(v[first], v[pivot]):
            first += 1
        last -= 1
        while comp(v[pivot], v[last]):
            last -= 1
        if not first < last:
            return first
        v[first], v[last] = v[last], v[first]
        first += 1


def _partition_pivot(v, first, last, comp):
    mid = first + (last - first) // 2
    _move_median_to_first(v, first, first + 1, mid, last - 1, comp)
    return _unguarded_partition(v, first + 1, last, first, comp)


def _adjust_heap(v, first, hole, length, value, comp):
    top = hole
    child = hole
    while child < (length - 1) // 2:
        child = 2 * (child + 1)
        if comp(v[first + child], v[first + child - 1]):
            child -= 1
        v[first + hole] = v[first + child]
        hole = child
    if (length & 1) == 0 and child == (length - 2) // 2:
        child = 2 * (child + 1)
        v[first + hole] = v[first + child - 1]
        hole = child - 1
    parent = (hole - 1) // 2
    while hole > top and comp(v[first + parent], value):
        v[first + hole] = v[first + parent]
        hole = parent
        parent = (hole - 1) // 2
    v[first + hole] = value


def _make_heap(v, first, last, comp):
    length = last - first
    if length < 2:
        return
    parent = (length - 2) // 2
    while True:
        _adjust_heap(v, first, parent, length, v[first + parent], comp)
        if parent == 0:
            return
        parent -= 1


def _pop_heap(v, first, last, result, comp):
    value = v[result]
    v[result] = v[first]
    _adjust_heap(v, first, 0, last - first, value, comp)


def _heap_select(v, first, middle, last, comp):
    _make_heap(v, first, middle, comp)
    for i in range(middle, last):
        if comp(v[i], v[first]):
            _pop_heap(v, first, middle, i, comp)


def _sort_heap(v, first, last, comp):
    while last - first > 1:
        last -= 1
        _pop_heap(v, first, last, last, comp)


def _partial_sort(v, first, middle, last, comp):
    _heap_select(v, first, middle, last, comp)
    _sort_heap(v, first, middle, comp)


def _lg(n):
    return n.bit_length() - 1


def _nth_element(v, first, nth, last, comp):
    if first == last or nth == last:
        return
    depth = 2 * _lg(last - first)
    while last - first > 3:
        if depth == 0:
            _heap_select(v, first, nth + 1, last, comp)
            v[first], v[nth] = v[nth], v[first]
            return
        depth -= 1
        cut = _partition_pivot(v, first, last, comp)
        if cut <= nth:
            first = cut
        else:
            last = cut
    _insertion_sort(v, first, last, comp)


_THRESHOLD = 16


def _introsort_loop(v, first, last, depth, comp):
    while last - first > _THRESHOLD:
        if depth == 0:
            _partial_sort(v, first, last, last, comp)
            return
        depth -= 1
        cut = _partition_pivot(v, first, last, comp)
        _introsort_loop(v, cut, last, depth, comp)
        last = cut


def _sort(v, first, last, comp):
    if first == last:
        return
    _introsort_loop(v, first, last, 2 * _lg(last - first), comp)
    if last - first > _THRESHOLD:
        _insertion_sort(v, first, first + _THRESHOLD, comp)
        for i in range(first + _THRESHOLD, last):
            _unguarded_linear_insert(v, i, comp)
    else:
        _insertion_sort(v, first, last, comp)


def torch_topk(values, k: int, largest: bool = True, sorted: bool = True):
    """``(indices, comparisons)``: the indices ``torch.topk(torch.tensor(values), k)`` returns on the CPU
    (see the module docstring), and how many comparisons the selection made."""
    n = len(values)
    if not 0 <= k <= n:
        raise ValueError(f"topk: k={k} out of range for {n} values")
    comp = _Cmp(largest)
    if k == 0:
        return [], 0
    v = [(float(x), j) for j, x in enumerate(values)]
    if k * 64 <= n:
        _partial_sort(v, 0, k, n, comp)
    else:
        _nth_element(v, 0, k - 1, n, comp)
        if sorted:
            _sort(v, 0, k - 1, comp)
    return [j for _, j in v[:k]], comp.calls


__all__ = ["torch_topk"]
