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

Everything runs on MXNet's engine, on the gradient's context, so a tensor is quantised,
packed and sent as soon as the backward pass has produced it, while the backward of
earlier layers goes on; nothing waits in Python. On the CPU two fused kernels
(_kernels.cc, built with the system compiler and loaded with ``mx.library.load``) do it
in one pass over memory each; elsewhere, or without a compiler, the stock operators do
the same arithmetic in about ten passes. MXNet 1.9 has no shift operators, so they pack
the fields with a product by powers of two (``dot``: sums of integers below 2**24 are
exact in float32) and unpack them with ``floor``. Element ``i`` of a tensor goes to word
``i % words``, field ``i // words``: the codes are a ``(fields, words)`` matrix in plain
row-major order, so no operator has to gather.
"""
from __future__ import annotations

import math

import mxnet as mx
import numpy as np

from .. import _kernels
from .base import Codec, check_number, exact_integers, plain_sum

# the largest integer float32 holds exactly is 2**24: a packed chunk stays below it
_FLOAT32_BITS = 24


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
    _array_fields = {"residual": "_residuals"}
    _private_fields = ("residual",)

    def __init__(self, threshold: float = 0.5, min_size: int = 0):
        self.threshold = check_number("threshold", threshold, 0, strict=True)
        self.min_size = check_number("min_size", min_size, 0, integer=True)
        self.params = {"threshold": self.threshold, "min_size": self.min_size}
        # index -> residual, flat, in the gradient's dtype, on its context (a NumPy
        # array between load_state() and the tensor's next step)
        self._residuals: dict = {}
        # index -> _Tensor: its packed words and how it travels
        self._tensors: dict = {}
        self._scratch = Scratch()

    def reduce(self, kv, indices, keys, grads, priority) -> None:
        carrier, bits = exact_integers(kv)
        packing = Packing.for_job(kv.num_workers, carrier, bits, kv.type)
        plain_keys, plain = [], []
        # backward order: the last layers' gradients are ready first
        for index, key, grad in reversed(list(zip(indices, keys, grads))):
            # a few calls into MXNet per tensor and step: with ResNet-50's 161 tensors
            # the Python side, not the kernels, sets the codec's pace
            signature = (grad.shape, grad.dtype, grad.context, packing)
            tensor = self._tensors.get(index)
            fresh = tensor is None or tensor.signature != signature
            if fresh:
                tensor = self._tensors[index] = _Tensor(signature, self.min_size)
            if tensor.plain:
                plain_keys.append(key)
                plain.append(grad)
                continue
            residual = self._residuals.get(index)
            if fresh or not isinstance(residual, mx.nd.NDArray):
                residual = self._residual(index, grad)
            urgency = -index if isinstance(index, int) else priority
            packing.encode(grad, residual, self.threshold, tensor.wire, self._scratch,
                           tensor.fused, urgency)
            kv.pushpull(f"{key}.2bit", tensor.wire, priority=urgency)
            packing.decode(tensor.wire, grad, self.threshold, self._scratch, tensor.fused,
                           tensor.size, urgency)
        plain_sum(kv, plain_keys[::-1], plain[::-1], priority)

    def _residual(self, index, grad) -> mx.nd.NDArray:
        residual = self._residuals.get(index)
        if isinstance(residual, np.ndarray) and residual.shape == (grad.size,):
            residual = mx.nd.array(residual, ctx=grad.context, dtype=grad.dtype)
        elif isinstance(residual, mx.nd.NDArray) and residual.shape == (grad.size,):
            # restored (a checkpoint's, or an elastic state's) on another device or dtype
            if residual.context != grad.context:
                residual = residual.as_in_context(grad.context)
            if residual.dtype != grad.dtype:
                residual = residual.astype(grad.dtype)
        else:
            residual = mx.nd.zeros((grad.size,), ctx=grad.context, dtype=grad.dtype)
        self._residuals[index] = residual
        return residual

    def local_state(self) -> dict:
        return {"residuals": {index: r.asnumpy() if isinstance(r, mx.nd.NDArray) else r
                              for index, r in self._residuals.items()}}

    def load_state(self, shared: dict, local: dict) -> None:
        self._residuals = {k: np.array(v).reshape(-1)
                           for k, v in local.get("residuals", {}).items()}


def _quantize(grad: mx.nd.NDArray, residual: mx.nd.NDArray, t: float,
              codes: mx.nd.NDArray, scratch: Scratch) -> None:
    """Write the codes (-1, 0, +1) of ``grad`` plus ``residual`` into the first
    ``grad.size`` elements of ``codes`` (float32), and update the residual: the stock
    operators' path."""
    size, ctx, dtype = grad.size, grad.context, grad.dtype
    mx.nd.elemwise_add(residual, grad.reshape((-1,)), out=residual)
    above = mx.nd._internal._greater_equal_scalar(
        residual, scalar=t, out=scratch.get("above", ctx, dtype, size))
    below = mx.nd._internal._lesser_equal_scalar(
        residual, scalar=-t, out=scratch.get("below", ctx, dtype, size))
    code = mx.nd.elemwise_sub(above, below, out=codes[:size] if dtype == np.float32
                              else scratch.get("code", ctx, dtype, size))
    # r - t, r + t or r - 0, as MXNet's kernel computes them, in the gradient's dtype
    mx.nd.elemwise_sub(residual, mx.nd._internal._mul_scalar(code, scalar=t, out=above),
                       out=residual)
    if dtype != np.float32:
        mx.nd.Cast(code, dtype="float32", out=codes[:size])


class _Tensor:
    """What the codec keeps of one gradient between steps, valid while its shape, dtype
    and context (``signature``) stay: its packed words (a key sent with a new array each
    step would wait for the previous one, so each tensor keeps its own), its size and
    whether it goes through the fused kernels."""

    def __init__(self, signature: tuple, min_size: int):
        self.signature = signature
        shape, dtype, ctx, packing = signature
        self.size = math.prod(shape)
        self.plain = self.size < max(min_size, 1)
        self.fused = packing.fused_for(dtype, ctx)
        self.wire = mx.nd.zeros((packing.words(self.size),), ctx=ctx, dtype=packing.carrier)


class Scratch:
    """Temporary arrays shared by the tensors of a codec, one per role, context and
    dtype, grown to the largest tensor: a fresh gradient-sized array per operator costs
    more than the operator (page faults), and one per tensor would double the model's
    memory. MXNet's engine orders the tensors' uses of a shared array."""

    def __init__(self):
        self._arrays: dict = {}

    def get(self, role: str, ctx, dtype, size: int) -> mx.nd.NDArray:
        """A flat array of ``size`` elements (a view of the shared one)."""
        key = (role, ctx, np.dtype(dtype))
        array = self._arrays.get(key)
        if array is None or array.size < size:
            array = self._arrays[key] = mx.nd.zeros((size,), ctx=ctx, dtype=dtype)
        return array[:size] if array.size > size else array


class Packing:
    """How one job packs codes: ``per_word`` fields of ``width`` bits (the sum of
    ``workers`` shifted codes, 0..2N) in a word of ``carrier`` dtype.

    Packing multiplies the ``(fields, words)`` matrix of codes by the fields' powers of
    two (one ``dot``), in chunks of fields of at most 24 bits, exact in float32; a float32
    carrier sends the one chunk as it is, an int32 carrier joins the chunks in integer
    arithmetic. Unpacking splits a word into its chunks (integer division), each chunk
    into ``floor(chunk / 2**(width j))`` for its fields ``j`` (exact: a product by a power
    of two), and one ``dot`` turns those into ``field - workers`` (``F_j - 2**width
    F_(j+1) - N``); a product by the threshold gives the dequantised value."""

    _cache: dict = {}

    def __init__(self, width: int, per_word: int, carrier: str, workers: int,
                 use_kernels: bool = True):
        self.width, self.per_word, self.carrier = width, per_word, carrier
        self.workers = workers
        # False: the stock operators even where the fused kernels load (tests compare)
        self.use_kernels = use_kernels
        if np.dtype(carrier) == np.float32 and width * per_word > _FLOAT32_BITS:
            raise ValueError(f"a float32 carrier sums {_FLOAT32_BITS} bits exactly, not "
                             f"{width * per_word}")
        self.per_chunk = min(per_word, _FLOAT32_BITS // width)
        self.chunks = -(-per_word // self.per_chunk)
        # a float32 carrier holds its one chunk as it is
        self.direct = self.chunks == 1 and np.dtype(carrier) == np.float32
        self._constants: dict = {}

    @classmethod
    def for_job(cls, workers: int, carrier: str, bits: int, backend: str) -> Packing:
        width = (2 * workers).bit_length()
        if bits // width < 1:
            raise ValueError(f"2-bit compression supports at most {2 ** (bits - 1) - 1} "
                             f"workers on the {backend!r} backend")
        key = (width, bits // width, carrier, workers)
        packing = cls._cache.get(key)
        if packing is None:
            packing = cls._cache[key] = cls(*key)
        return packing

    def words(self, size: int) -> int:
        return -(-size // self.per_word)

    def fused(self, grad: mx.nd.NDArray) -> bool:
        """Whether ``grad`` goes through the fused kernels (:mod:`dist_gluon._kernels`)."""
        return self.fused_for(grad.dtype, grad.context)

    def fused_for(self, dtype, ctx) -> bool:
        return self.use_kernels and _kernels.serves(dtype, ctx)

    def encode(self, grad: mx.nd.NDArray, residual: mx.nd.NDArray, threshold: float,
               wire: mx.nd.NDArray, scratch: Scratch, fused: bool | None = None,
               priority: int = 0) -> None:
        """Quantise ``grad`` plus ``residual`` (updated) and pack the codes into
        ``wire``; ``fused``: :meth:`fused` of ``grad``, if the caller knows it."""
        if self.fused(grad) if fused is None else fused:
            _kernels.push("dg_twobit_quantize", [grad, residual], [wire], priority,
                          threshold=threshold, width=self.width, per_word=self.per_word,
                          carrier=self.carrier)
            return
        codes = scratch.get("codes", grad.context, "float32", wire.size * self.per_word)
        _quantize(grad, residual, threshold, codes, scratch)
        self.pack(codes, wire)

    def decode(self, wire: mx.nd.NDArray, grad: mx.nd.NDArray, threshold: float,
               scratch: Scratch, fused: bool | None = None, size: int | None = None,
               priority: int = 0) -> None:
        """Unpack the summed ``wire`` into ``grad``: ``threshold * (field - workers)``."""
        if self.fused(grad) if fused is None else fused:
            size = grad.size if size is None else size
            _kernels.push("dg_twobit_dequantize", [wire], [grad.reshape((size,))], priority,
                          threshold=threshold, width=self.width, per_word=self.per_word,
                          workers=self.workers, size=size, dtype=np.dtype(grad.dtype).name)
            return
        self.unpack(wire, grad, threshold, scratch)

    def pack(self, codes: mx.nd.NDArray, wire: mx.nd.NDArray) -> None:
        """``wire[w]`` = sum over fields ``j`` of ``(codes[j * words + w] + 1) << (width *
        j)``, queued on the engine. ``codes`` holds ``per_word * words`` codes."""
        c = self._on(codes.context)
        matrix = codes.reshape((self.per_word, wire.size))
        if self.direct:
            mx.nd.dot(c["pack"], matrix, out=wire.reshape((1, wire.size)))
        else:
            chunks = mx.nd.Cast(mx.nd.dot(c["pack"], matrix), dtype=self.carrier)
            mx.nd.sum(mx.nd.broadcast_mul(chunks, c["chunk_scale"]), axis=0, out=wire)
        wire += c["offset"]

    def unpack(self, wire: mx.nd.NDArray, grad: mx.nd.NDArray, threshold: float,
               scratch: Scratch) -> None:
        """``grad`` = ``threshold * (field - workers)`` for the fields of the summed
        ``wire``, in ``grad``'s dtype, as MXNet's dequantisation gives them."""
        c = self._on(wire.context)
        ctx, words, fields = wire.context, wire.size, self.chunks * self.per_chunk
        if self.direct:
            chunks = wire.reshape((1, 1, words))
        else:
            # chunk q = (word >> (width * per_chunk * q)) & mask, in integers
            shifted = mx.nd.broadcast_div(wire.reshape((1, words)), c["chunk_scale"])
            if self.chunks > 1:
                high = mx.nd._internal._mul_scalar(shifted[1:], scalar=c["chunk_base"])
                mx.nd.elemwise_sub(shifted[:-1], high, out=shifted[:-1])
            chunks = mx.nd.Cast(shifted, dtype="float32").reshape((self.chunks, 1, words))
        # [1; floor(chunk / 2**(width j)) for every field j of every chunk]
        table = scratch.get("table", ctx, "float32", (fields + 1) * words)
        table[:words] = 1.0
        floors = table[words:].reshape((self.chunks, self.per_chunk, words))
        mx.nd.broadcast_mul(chunks, c["field_scale"], out=floors)
        mx.nd.floor(floors, out=floors)
        table = table.reshape((fields + 1, words))
        # the first rows of fields lie inside the gradient, the next one is cut at its size
        rows = grad.size // words
        head, rest = rows * words, grad.size - rows * words
        flat, unfold = grad.reshape((-1,)), c["fields"]
        if rest:
            tail = scratch.get("tail", ctx, "float32", words)
            mx.nd.dot(unfold[rows:rows + 1], table, out=tail.reshape((1, words)))
            tail = tail[:rest]
        if grad.dtype == np.float32:
            inside = flat[:head]
            mx.nd.dot(unfold[:rows], table, out=inside.reshape((rows, words)))
            mx.nd._internal._mul_scalar(inside, scalar=threshold, out=inside)
            if rest:
                mx.nd._internal._mul_scalar(tail, scalar=threshold, out=flat[head:])
            return
        values = scratch.get("values", ctx, grad.dtype, grad.size)
        inside = scratch.get("inside", ctx, "float32", head)
        mx.nd.dot(unfold[:rows], table, out=inside.reshape((rows, words)))
        mx.nd.Cast(inside, dtype=grad.dtype, out=values[:head])
        if rest:
            mx.nd.Cast(tail, dtype=grad.dtype, out=values[head:])
        mx.nd._internal._mul_scalar(values, scalar=threshold, out=flat)

    def _on(self, ctx) -> dict:
        """The packing constants on ``ctx`` (made once)."""
        constants = self._constants.get(ctx)
        if constants is None:
            width, per_chunk, chunks = self.width, self.per_chunk, self.chunks
            fields = chunks * per_chunk
            pack = np.zeros((chunks, self.per_word), np.float32)
            for j in range(self.per_word):
                pack[j // per_chunk, j] = 2.0 ** (width * (j % per_chunk))
            # field j = F_j - 2**width F_(j+1) - workers, F_j the floors of the table
            # (column 0 the ones), F_(j+1) = 0 past a chunk's last field
            unfold = np.zeros((self.per_word, fields + 1), np.float32)
            for j in range(self.per_word):
                unfold[j, 0] = -self.workers
                unfold[j, 1 + j] = 1.0
                if (j + 1) % per_chunk:
                    unfold[j, 2 + j] = -(2.0 ** width)
            chunk_scale = [[2 ** (width * per_chunk * q)] for q in range(chunks)]
            constants = self._constants[ctx] = {
                "pack": mx.nd.array(pack, ctx=ctx),
                "chunk_scale": mx.nd.array(chunk_scale, ctx=ctx, dtype=self.carrier),
                "chunk_base": float(2 ** (width * per_chunk)),
                "offset": float(sum(2 ** (width * j) for j in range(self.per_word))),
                "field_scale": mx.nd.array(
                    [[[2.0 ** -(width * j)] for j in range(per_chunk)]], ctx=ctx),
                "fields": mx.nd.array(unfold, ctx=ctx),
            }
        return constants


def _pack(codes: np.ndarray, width: int, per_word: int, carrier: str = "int32",
          fused: bool = False) -> np.ndarray:
    """NumPy in, NumPy out: the words of codes -1..1, by :meth:`Packing.encode` of
    ``codes / 2`` with threshold 1/2 and no residual (for tests)."""
    packing = Packing(width, per_word, carrier, workers=0, use_kernels=fused)
    wire = mx.nd.zeros((packing.words(codes.size),), dtype=carrier)
    packing.encode(mx.nd.array(codes * 0.5, dtype="float32"), mx.nd.zeros((codes.size,)),
                   0.5, wire, Scratch())
    return wire.asnumpy()


def _unpack(words: np.ndarray, width: int, per_word: int, size: int,
            fused: bool = False) -> np.ndarray:
    """NumPy in, NumPy out: the fields of summed ``words`` (each the sum of the workers'
    shifted codes) in the codes' order, by :meth:`Packing.decode` (for tests)."""
    carrier = "float32" if words.dtype == np.float32 else "int32"
    fields = mx.nd.zeros((size,), dtype="float64")
    Packing(width, per_word, carrier, workers=0, use_kernels=fused).decode(
        mx.nd.array(words, dtype=carrier), fields, threshold=1.0, scratch=Scratch())
    return fields.asnumpy().astype(np.int64)
