"""Row-sparse gradients (``gluon.nn.Embedding(..., sparse_grad=True)``) summed over the
workers, on every backend, with the cost of the rows in use rather than of the whole
table.

A row_sparse gradient holds the rows of the words in this worker's batch. One process
on the concatenated batch would hold the rows of the union ``U`` of every worker's rows,
each the sum of the workers' contributions, and a lazy optimizer (SGD, Adam with
``lazy_update``) updates exactly those rows. So each worker learns ``U`` (an all-gather
of the row ids, a few integers per word of the batch), sums a dense block of ``|U| x
dim`` values over the workers with the backend's ordinary sum, and gets back a row_sparse
gradient with rows ``U``: the same rows and values as one process, on every rank.

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
        ``{'rows': |U|, 'sent': elements given to the backend's sum, 'dense': bool}``.
    """
    own = grad.indices.asnumpy().astype(np.int64)
    every = kv.allgather_object(own)
    union = np.unique(np.concatenate(every)) if every else own
    height, width = grad.shape[0], int(np.prod(grad.shape[1:]))
    size = bucket(len(union))
    if size >= DENSE_FRACTION * height:
        dense = _on_the_wire(grad.tostype("default"), wire_dtype)
        kv.pushpull(_wire_key(f"{key}.dense", wire_dtype), dense, priority=priority)
        values = dense.asnumpy()[union] if len(union) else np.zeros((0,) + grad.shape[1:])
        sent = dense.size
    else:
        block = np.zeros((size,) + grad.shape[1:], dtype=wire_dtype or grad.dtype)
        if len(own):
            block[np.searchsorted(union, own)] = grad.data.asnumpy()
        wire = mx.nd.array(block, dtype=block.dtype)
        kv.pushpull(_wire_key(f"{key}.rows{size}", wire_dtype), wire, priority=priority)
        values = wire.asnumpy()[:len(union)]
        sent = size * width
    total = mx.nd.sparse.row_sparse_array(
        (mx.nd.array(values, dtype=grad.dtype), mx.nd.array(union, dtype="int64")),
        shape=grad.shape, ctx=grad.context, dtype=grad.dtype)
    total.copyto(grad)
    return {"rows": int(len(union)), "sent": int(sent), "dense": size >= DENSE_FRACTION * height}


def _on_the_wire(array: mx.nd.NDArray, wire_dtype) -> mx.nd.NDArray:
    return array if wire_dtype is None else array.astype(wire_dtype)


def _wire_key(key: str, wire_dtype) -> str:
    # on ps-lite a key keeps its first dtype
    return key if wire_dtype is None else f"{key}.{np.dtype(wire_dtype).name}"
