"""fp16: gradients travel as float16 (half the bytes of float32), as in Horovod."""
from __future__ import annotations

import mxnet as mx
import numpy as np

from .. import _kernels
from .base import Codec


class FP16(Codec):
    """Gradients travel as float16 and come back in their own dtype. Sums of many
    workers can leave float16's range: ``gradient_predivide_factor`` keeps them in it.

    Each tensor keeps its float16 wire buffer between steps: the casts and the sum are
    queued on MXNet's engine, and a key sent with the same array every step never waits
    for its previous sum. A float32 gradient on the CPU is converted by the fused
    kernels (F16C, :mod:`dist_gluon._kernels`; 3-6x MXNet's ``Cast``, the same values),
    any other by ``Cast``."""

    name = "fp16"
    batched = False     # one call per tensor keeps per-tensor priorities (P3)

    def __init__(self):
        self.params = {}
        self._wires: dict = {}      # index -> float16 buffer on the gradient's context

    def reduce(self, kv, indices, keys, grads, priority) -> None:
        wires = [self._wire(i, g) for i, g in zip(indices, grads)]
        # on ps-lite a key keeps its first dtype
        keys = [k + ".fp16" if w is not g else k for k, g, w in zip(keys, grads, wires)]
        fused = [w is not g and g.dtype == np.float32 and _kernels.serves(g.dtype, g.context)
                 for g, w in zip(grads, wires)]
        for g, w, f in zip(grads, wires, fused):
            if f:
                _kernels.push("dg_fp16_pack", [g], [w], priority)
            elif w is not g:
                mx.nd.Cast(g, dtype="float16", out=w)
        if len(keys) == 1:
            kv.pushpull(keys[0], wires[0], priority=priority)
        else:
            kv.pushpull(keys, wires, priority=priority)
        for g, w, f in zip(grads, wires, fused):
            if f:
                _kernels.push("dg_fp16_unpack", [w], [g], priority)
            elif w is not g:
                mx.nd.Cast(w, dtype=g.dtype, out=g)

    def _wire(self, index, grad: mx.nd.NDArray) -> mx.nd.NDArray:
        if grad.dtype == np.float16:
            return grad
        wire = self._wires.get(index)
        if wire is None or wire.shape != grad.shape or wire.context != grad.context:
            wire = self._wires[index] = mx.nd.empty(grad.shape, ctx=grad.context,
                                                    dtype="float16")
        return wire
