"""fp16: gradients travel as float16 (half the bytes of float32), as in Horovod."""
from __future__ import annotations

import mxnet as mx
import numpy as np

from .base import Codec


class FP16(Codec):
    """Gradients travel as float16 and come back in their own dtype. Sums of many
    workers can leave float16's range: ``gradient_predivide_factor`` keeps them in it."""

    name = "fp16"
    batched = False     # one call per tensor keeps per-tensor priorities (P3)

    def __init__(self):
        self.params = {}

    def reduce(self, kv, indices, keys, grads, priority) -> None:
        wires = [g if g.dtype == np.float16 else g.astype("float16") for g in grads]
        # on ps-lite a key keeps its first dtype
        keys = [k + ".fp16" if w is not g else k for k, g, w in zip(keys, grads, wires)]
        if len(keys) == 1:
            kv.pushpull(keys[0], wires[0], priority=priority)
        else:
            kv.pushpull(keys, wires, priority=priority)
        for g, w in zip(grads, wires):
            if w is not g:
                mx.nd.Cast(w, dtype=g.dtype, out=g)
