"""A worker's several devices: sum their gradients on the first, copy the result back.

One process driving several devices (``ctx=[mx.gpu(0), mx.gpu(1), ...]``, MXNet's
classic layout) sends one sum per tensor over the network, as MXNet's ``device`` and
``dist_sync`` kvstores do: the devices' gradients are first summed on the first device
with MXNet's own operators (queued on the engine, nothing waits), that sum is averaged
over the workers, and the result is copied back to every device, whose own updater then
applies it. Both trainers (Gluon and Module) use these two functions.
"""
from __future__ import annotations

import mxnet as mx


def sum_into_first(grads: list[mx.nd.NDArray]) -> mx.nd.NDArray:
    """``grads[0] = sum(grads)`` on the first array's device; returns ``grads[0]``."""
    first = grads[0]
    others = [g.as_in_context(first.context) for g in grads[1:]]
    if first.stype == "default":
        for grad in others:
            first += grad
    elif others:
        mx.nd.add_n(first, *others).copyto(first)      # row_sparse: the union of rows
    return first


def copy_from_first(grads: list[mx.nd.NDArray]) -> None:
    """Copy ``grads[0]`` into every other device's array."""
    first = grads[0]
    for grad in grads[1:]:
        first.copyto(grad)
