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

from . import worker

_FORMS = ("'cpu', 'gpu' (GPU number DG_LOCAL_RANK: one process per GPU), 'gpu:0,1,2,3' "
          "(this process drives those GPUs) or 'cpu:0,1' (CPU contexts, to try that "
          "layout without GPUs)")


def parse_devices(spec: str | None = None, local_rank: int | None = None) -> list:
    """The devices one worker drives, from a command-line value such as ``--devices``.

    Parameters
    ----------
    spec : str or None
        ``'cpu'`` (also None or ``''``): ``[mx.cpu()]``.
        ``'gpu'``: ``[mx.gpu(local_rank)]``, one process per GPU (Horovod's layout; start
        as many workers per node as it has GPUs).
        ``'gpu:0,1,2,3'``: those GPUs, all driven by this process (MXNet's classic layout;
        one worker per node). ``'cpu:0,1'``: CPU contexts, the same layout on a machine
        without GPUs (for trying it out; they share the CPU).
    local_rank : int, optional
        The worker's rank on its node; by default DG_LOCAL_RANK (0 outside the launcher).

    Returns
    -------
    list of mx.Context

    Raises
    ------
    ValueError
        A malformed spec, or a GPU this machine does not have (naming how many it has).

    Examples
    --------
    >>> ctx = dg.parse_devices(args.devices)          # e.g. --devices gpu:0,1,2,3
    >>> net.initialize(mx.init.Xavier(), ctx=ctx)
    >>> parts = gluon.utils.split_and_load(batch, ctx)
    """
    spec = (spec or "cpu").strip().lower()
    kind, _, numbers = spec.partition(":")
    if kind not in ("cpu", "gpu"):
        raise ValueError(f"devices {spec!r}: expected {_FORMS}")
    if numbers:
        try:
            ids = [int(n) for n in numbers.split(",")]
        except ValueError:
            raise ValueError(f"devices {spec!r}: expected {_FORMS}") from None
        if any(i < 0 for i in ids) or len(set(ids)) != len(ids):
            raise ValueError(f"devices {spec!r}: device numbers must be distinct and >= 0")
    elif kind == "gpu":
        ids = [worker.context().local_rank if local_rank is None else local_rank]
    else:
        ids = [0]
    if kind == "gpu":
        available = mx.context.num_gpus()
        missing = [i for i in ids if i >= available]
        if missing:
            raise ValueError(f"devices {spec!r}: GPU {missing[0]} does not exist, this "
                             f"machine has {available} GPU(s); use 'cpu' without GPUs")
        return [mx.gpu(i) for i in ids]
    return [mx.cpu(i) for i in ids]


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
