"""2-bit quantisation with error feedback, with MXNet's semantics, packed both ways.

MXNet's ``kv.set_gradient_compression({'type': '2bit', 'threshold': t})`` sends each
gradient element as one of three values, +t, -t or 0, and keeps what was not sent as a
residual that is added to the next gradient (error feedback). This codec computes
exactly that, element by element in the gradient's dtype:

    r += g
    code = +1 if r >= t, -1 if r <= -t, else 0
    r -= code * t

and the optimizer sees ``t * (sum of the workers' codes)``, divided by the summed batch
sizes as without compression. MXNet compresses only the push to its servers and pulls
float32 sums. Here both directions are small: a worker's codes, shifted to 0..2, are
packed into fields of ``w`` bits of a wider integer (``w`` bits hold the sum of N
workers' fields, 0..2N, so the sum of packed words is the packed sums, with no carry
between fields), and the backend's ordinary sum adds the packed words. horovod sums int32
words (31 bits); the ps-lite servers sum float32, exact on 24 bits. Bits per element:

    workers N        2     3-4    5-8    9-16
    field w          3      4      5      6
    horovod (31)   3.1    4.4    5.2    6.2
    ps-lite (24)   3.0    4.0    6.0    6.0     (32 / fields per word)

against 32 for float32, both ways; MXNet's 2-bit pushes 2 bits and pulls 32.
"""
from __future__ import annotations

import mxnet as mx
import numpy as np

from .base import Codec, check_number, exact_integers, plain_sum


class TwoBit(Codec):
    """MXNet's 2-bit gradient compression (see the module docstring).

    Parameters
    ----------
    threshold : float, default 0.5
        MXNet's name and default: values of at least ``threshold`` in magnitude are sent
        as ``+-threshold``; the rest waits in the residual.
    min_size : int, default 0
        Tensors with fewer elements travel uncompressed (MXNet compresses every tensor;
        biases and BatchNorm parameters gain little from it).
    """

    name = "2bit"

    def __init__(self, threshold: float = 0.5, min_size: int = 0):
        self.threshold = check_number("threshold", threshold, 0, strict=True)
        self.min_size = check_number("min_size", min_size, 0, integer=True)
        self.params = {"threshold": self.threshold, "min_size": self.min_size}
        self._residuals: dict = {}

    def reduce(self, kv, indices, keys, grads, priority) -> None:
        workers = kv.num_workers
        carrier, bits = exact_integers(kv)
        width = (2 * workers).bit_length()
        per_word = bits // width
        if per_word < 1:
            raise ValueError(f"2-bit compression supports at most {2 ** (bits - 1) - 1} "
                             f"workers on the {kv.type!r} backend")
        plain_keys, plain, sent = [], [], []
        for index, key, grad in zip(indices, keys, grads):
            if grad.size < max(self.min_size, 1):
                plain_keys.append(key)
                plain.append(grad)
                continue
            codes = self._quantize(index, grad)
            wire = mx.nd.array(_pack(codes, width, per_word).astype(carrier), dtype=carrier)
            kv.pushpull(f"{key}.2bit", wire, priority=priority)
            sent.append((grad, wire))
        plain_sum(kv, plain_keys, plain, priority)
        for grad, wire in sent:
            # a field (the sum of N shifted codes) k stands for (k - N) * threshold
            dtype = np.dtype(grad.dtype)
            values = _unpack(wire.asnumpy(), width, per_word, grad.size).astype(dtype)
            values -= workers
            values *= dtype.type(self.threshold)
            grad[:] = values.reshape(grad.shape)

    def _quantize(self, index, grad: mx.nd.NDArray) -> np.ndarray:
        """This worker's codes (-1, 0, +1 as int8) for ``grad``; updates its residual."""
        g = grad.asnumpy().reshape(-1)
        residual = self._residuals.get(index)
        if residual is None or residual.shape != g.shape or residual.dtype != g.dtype:
            residual = self._residuals[index] = np.zeros_like(g)
        residual += g
        t = g.dtype.type(self.threshold)
        codes = (residual >= t).view(np.int8) - (residual <= -t).view(np.int8)
        # r - t, r + t or r - 0, as MXNet's kernel computes them
        residual -= np.multiply(codes, t, dtype=g.dtype)
        return codes

    def local_state(self) -> dict:
        return {"residuals": dict(self._residuals)}

    def load_state(self, shared: dict, local: dict) -> None:
        self._residuals = {k: np.array(v) for k, v in local.get("residuals", {}).items()}


def _pack(codes: np.ndarray, width: int, per_word: int) -> np.ndarray:
    """Codes -1..1 shifted to 0..2, ``per_word`` of them per uint32 word, ``width`` bits
    each. Element ``i`` goes to word ``i % words``, field ``i // words``: every field is
    a contiguous run of the codes, so packing and unpacking are a few passes over
    contiguous memory."""
    words = -(-codes.size // per_word)
    shifted = np.ones(words * per_word, dtype=np.uint32)      # padding: code 0
    shifted[:codes.size] += codes.astype(np.uint32, copy=False)   # wraps -1 + 1 to 0
    shifted = shifted.reshape(per_word, words)
    packed = shifted[0].copy()
    for j in range(1, per_word):
        shifted[j] <<= np.uint32(width * j)
        packed |= shifted[j]
    return packed


def _unpack(packed: np.ndarray, width: int, per_word: int, size: int) -> np.ndarray:
    """The fields of summed words (each the sum of the workers' shifted codes), in the
    codes' order."""
    words = np.rint(packed).astype(np.uint32) if packed.dtype.kind == "f" \
        else packed.astype(np.uint32, copy=False)
    mask = np.uint32((1 << width) - 1)
    fields = np.empty((per_word, words.size), dtype=np.uint8 if width <= 8 else np.uint16)
    for j in range(per_word):
        np.bitwise_and(words >> np.uint32(width * j), mask, out=fields[j], casting="unsafe")
    return fields.reshape(-1)[:size]
