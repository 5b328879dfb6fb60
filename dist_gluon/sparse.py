"""Row-sparse gradients (``gluon.nn.Embedding(..., sparse_grad=True)``) summed over the
workers, on every backend, with the cost of the rows in use rather than of the whole
table.

A row_sparse gradient holds the rows of the words in this worker's batch. One process
on the concatenated batch would hold the rows of the union ``U`` of every worker's rows,
each the sum of the workers' contributions, and a lazy optimizer (SGD, Adam with
``lazy_update``) updates exactly those rows. So each worker learns ``U``, sums a dense
block of ``|U| x dim`` values over the workers with the backend's ordinary sum, and gets
back a row_sparse gradient with rows ``U``: the same rows and values as one process, on
every rank.

Everything runs on the gradient's device, through the backend's sums (no pickled
objects, no NumPy): (1) the workers' row counts, each in its own slot of a zero vector,
summed (the only values read on the host: one small array of ``workers`` numbers, which
size what follows); (2) every worker's row ids, padded to the largest count rounded up
to a power of two, each in its own row of a zero matrix, summed (an all-gather; ids
travel as ``id + 1`` in float32, exact below 2**24 rows, float64 above); (3) the union,
sorted, by scattering the gathered ids into a mask of the table's height
(``scatter_nd``) and keeping the marked rows (``contrib.boolean_mask``); (4) the block
of values, each worker's rows scattered to their places in ``U``, summed.

The block's rows are rounded up to a power of two, so a ps-lite key (which keeps its
first shape) serves every step of similar size and a job uses a handful of keys. When
the rounded block would hold at least half of the table, the dense gradient is summed
instead (no larger, and one key), and its rows ``U`` are taken from the sum: the
semantics do not depend on the choice. Of the codecs only fp16 applies to these sums
(the block travels as float16); 2-bit and PowerSGD need the whole dense tensor and
refuse a row_sparse gradient (dist_gluon/averaging.py).
"""
from __future__ import annotations

import mxnet as mx
import numpy as np

# A block with at least this fraction of the table's rows travels as the dense gradient.
DENSE_FRACTION = 0.5
# Row ids travel in float32 below this table height (exact integers), else in float64.
_FLOAT32_EXACT = 1 << 24


def bucket(rows: int) -> int:
    """``rows`` rounded up to a power of two (at least 1)."""
    return 1 << max(0, int(rows) - 1).bit_length()


def sum_row_sparse(kv, key: str, grad: mx.nd.NDArray, priority: int = 0,
                   wire_dtype=None) -> dict:
    """Sum the row_sparse ``grad`` over the workers in place (see the module docstring).
    Call it on every rank, in the same order as every other collective. With
    ``wire_dtype`` (float16 for the fp16 codec) the summed block travels in that dtype.

    Returns
    -------
    dict
        ``{'rows': |U|, 'sent': elements of values given to the backend's sum,
        'dense': bool}``.
    """
    height, ctx = grad.shape[0], grad.context
    union = _union_of_rows(kv, key, grad, priority)
    rows = 0 if union is None else union.shape[0]
    size = bucket(rows)
    dense = size >= DENSE_FRACTION * height
    if dense:
        wire = _on_the_wire(grad.tostype("default"), wire_dtype)
        kv.pushpull(_wire_key(f"{key}.dense", wire_dtype), wire, priority=priority)
        values = mx.nd.take(wire, union) if rows else None
        sent = wire.size
    else:
        wire = mx.nd.zeros((size,) + grad.shape[1:], ctx=ctx, dtype=wire_dtype or grad.dtype)
        if grad.indices.shape[0]:
            # where each of this worker's rows sits in the union
            place = mx.nd.scatter_nd(mx.nd.arange(rows, ctx=ctx, dtype="float32"),
                                     union.reshape((1, -1)), shape=(height,))
            own = mx.nd.take(place, grad.indices).reshape((1, -1))
            wire = mx.nd.scatter_nd(_on_the_wire(grad.data, wire_dtype), own,
                                    shape=wire.shape)
        kv.pushpull(_wire_key(f"{key}.rows{size}", wire_dtype), wire, priority=priority)
        values = wire[:rows] if rows else None
        sent = wire.size
    if values is None:
        total = mx.nd.sparse.zeros("row_sparse", grad.shape, ctx=ctx, dtype=grad.dtype)
    else:
        if values.dtype != grad.dtype:
            values = values.astype(grad.dtype)
        total = mx.nd.sparse.row_sparse_array((values, union), shape=grad.shape, ctx=ctx,
                                              dtype=grad.dtype)
    total.copyto(grad)
    return {"rows": int(rows), "sent": int(sent), "dense": dense}


def _union_of_rows(kv, key: str, grad: mx.nd.NDArray, priority: int):
    """The sorted union of every worker's row ids (int64, on the gradient's device), or
    None when no worker has a row."""
    height, ctx = grad.shape[0], grad.context
    workers, rank = kv.num_workers, kv.rank
    own = grad.indices
    counts = mx.nd.one_hot(mx.nd.full((1,), rank, ctx=ctx), workers).reshape((-1,))
    counts *= own.shape[0]
    kv.pushpull(f"{key}.counts", counts, priority=priority)
    largest = int(counts.max().asscalar())
    if largest == 0:
        return None
    width = bucket(largest)
    id_dtype = "float32" if height < _FLOAT32_EXACT else "float64"
    ids = mx.nd.zeros((workers, width), ctx=ctx, dtype=id_dtype)
    if own.shape[0]:
        # ids + 1 in this worker's row, 0 (no row) in the padding and in the others' rows
        ids[rank, :own.shape[0]] = own.astype(id_dtype) + 1
    kv.pushpull(f"{key}.ids{width}.{id_dtype}", ids, priority=priority)
    marked = mx.nd.scatter_nd(mx.nd.ones((workers * width,), ctx=ctx),
                              ids.reshape((1, -1)), shape=(height + 1,))
    return mx.nd.contrib.boolean_mask(mx.nd.arange(height, ctx=ctx, dtype="int64"),
                                      marked[1:])


def _on_the_wire(array: mx.nd.NDArray, wire_dtype) -> mx.nd.NDArray:
    return array if wire_dtype is None else array.astype(wire_dtype)


def _wire_key(key: str, wire_dtype) -> str:
    # on ps-lite a key keeps its first dtype
    return key if wire_dtype is None else f"{key}.{np.dtype(wire_dtype).name}"
