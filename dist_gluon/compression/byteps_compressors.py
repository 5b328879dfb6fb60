"""BytePS's gradient compressors (onebit, topk, randomk, dithering) with its error
feedback and Nesterov momentum, as codecs on every backend.

BytePS compresses a tensor on each worker, its servers decompress every worker's
message, sum them, compress the sum again and send that back, and each worker
decompresses it. Error feedback runs on both sides: a worker keeps what its message did
not carry, the server keeps what its reply did not. Here there are no BytePS servers,
so every worker plays the server's part on the same sum, with the same arithmetic: the
reply, and the server's error, come out bit for bit equal on every worker. Per tensor,
with ``g`` this worker's gradient (as the trainer hands it over):

1. momentum (``momentum='nesterov'``, mu = ``momentum_mu``): ``m = g + mu * m``;
   ``p = g + mu * m``; else ``p = g``.
2. error feedback (``ef='vanilla'``): ``p += (lr_previous / lr_now) * e``.
3. ``c = compress(p)``; with error feedback ``e = p - decompress(c)``.
4. every worker's ``c`` is gathered (see "On the wire" below) and each worker forms the
   server's sum ``S = sum_i decompress(c_i)``.
5. the server's turn: ``q = S + ratio * e_s`` (with error feedback),
   ``c_s = compress(q)``, ``e_s = q - decompress(c_s)``; the gradient becomes
   ``decompress(c_s)``.

Tensors smaller than ``min_compress_bytes`` (BytePS's ``BYTEPS_MIN_COMPRESS_BYTES``,
65536) travel uncompressed; with momentum they get BytePS's Nesterov step after the
sum (its Python ``NagAdapter``): ``m = mu * (m + S)``, gradient ``S + m``, unless
``momentum_uncompressed=False`` (dist_gluon.compat.byteps's trainer runs the adapter
itself, after the weight decay, as BytePS's does).

The compressors (``compress``; ``decompress`` fills a zero tensor):

onebit
    the signs, and ``mean(|p|)`` as the scale with ``scaling=True`` (else 1): each
    element decompresses to ``-scale`` where ``p < 0``, ``+scale`` elsewhere.
topk (``k``)
    the ``k`` elements of largest magnitude with their indices.
randomk (``k``, ``seed``)
    ``k`` indices drawn uniformly with replacement, with their values.
dithering (``k`` levels, ``partition``, ``normalize``, ``seed``)
    ``scale`` = max(|p|) (``normalize='max'``) or the L2 norm (``'l2'``); ``x =
    |p| / scale * k`` (linear) rounded down or up at random, with the probability of
    rounding up equal to the fraction, so the expectation is ``x``; ``'natural'``
    rounds ``|p| / scale * 2**(k-1)`` to one of the two neighbouring powers of two (or
    0 and 1) the same way. It decompresses to ``sign(p) * level * scale / levels``.

``k`` below 1 is a fraction of the tensor's elements (at least 1); BytePS requires
``k <= size / 2`` for topk and randomk. Random draws: with ``seed`` every worker and
the server draw the same numbers at the same step, as in BytePS, where each of them
seeds its generator with ``seed``; without it, each worker draws its own. The numbers
come from a counter-based hash of (seed, step, element), computed with MXNet operators,
not from BytePS's xorshift128+ stream, so a seeded run picks other indices than
BytePS's.

On the wire (through the backend's sum, the collective every backend has):

* onebit and dithering: each worker's codes packed into float32 words, 24 bits of each
  (a float32 sums integers exactly up to 2**24), fields of 1 bit (onebit) or of
  ``bit_length(2 * levels)`` bits (dithering: a signed level), plus the scale; every
  worker writes its row of a zero (workers x words) buffer and the sum is every
  worker's row: an allgather. Per element: N/24 float32 words for onebit, against 1.
  On the CPU, onebit's step (momentum, error feedback, packing; the server's
  decompress-and-sum, error feedback and reply) is two fused kernels of
  :mod:`dist_gluon._kernels`, where the stock operators need about thirty passes over memory:
  the same words and values, so workers with and without them work together.
* topk and randomk: the ``k`` (index, value) pairs of every worker, gathered the same
  way: 2 N k numbers against the tensor's size. The server's sum needs each worker's
  pairs decompressed separately (duplicate indices of randomk are one value, not a
  sum), so the pairs travel, not a dense sum.

Differences from BytePS: BytePS compresses each partition of a tensor
(``BYTEPS_PARTITION_BYTES``, 4 MB) separately, here the whole tensor is one; the error
feedback's learning-rate ratio needs the trainer to tell the codec its learning rate
(:meth:`set_learning_rate`; DistributedTrainer and the BytePS-style trainer do at
every step, as BytePS's trainer writes its ``lr.s`` file); with one process nothing is
compressed and no momentum is added, as in BytePS, which compresses only in distributed jobs.
"""
from __future__ import annotations

import os
from typing import Any

import mxnet as mx
import numpy as np

from .. import _kernels
from .base import Codec, check_number, plain_sum

# bits of a float32 word that a sum of zeros and one integer keeps exactly
_WORD_BITS = 24
# a fixed stream for the server's draws when no seed is given (the same on every worker)
_SERVER_SALT = 0x5EED5
_MASK32 = (1 << 32) - 1


def _flag(value) -> bool:
    """BytePS's rule for optional settings: '', None, False and 0 mean "not set"."""
    return bool(value)


def _hash32_host(x: int) -> int:
    """The element hash of :func:`_uniforms`, on one Python int (for the stream keys)."""
    x &= _MASK32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK32
    x ^= x >> 15
    x = (x * 0x5BD1E995) & _MASK32
    x ^= x >> 16
    return x


def _hash32(x: mx.nd.NDArray) -> mx.nd.NDArray:
    """lowbias32-style integer hash of int64 values in [0, 2**32), in MXNet operators.
    The products (below 2**63) multiply two int64 arrays: MXNet's scalar operators
    compute in double, which is not exact there. Shifts are divisions of integers below
    2**32, which doubles hold exactly."""
    first, second = _constants(x.context)
    x = _xor(x, x / 65536)
    x = _low32(mx.nd.broadcast_mul(x, first))
    x = _xor(x, x / 32768)
    x = _low32(mx.nd.broadcast_mul(x, second))
    return _xor(x, x / 65536)


_CONSTANTS: dict = {}


def _constants(ctx) -> tuple:
    found = _CONSTANTS.get(ctx)
    if found is None:
        found = _CONSTANTS[ctx] = tuple(mx.nd.array([c], ctx=ctx, dtype="int64")
                                        for c in (0x7FEB352D, 0x5BD1E995))
    return found


def _low32(x: mx.nd.NDArray) -> mx.nd.NDArray:
    return mx.np.bitwise_and(x.as_np_ndarray(), _MASK32).as_nd_ndarray()


def _xor(a: mx.nd.NDArray, b) -> mx.nd.NDArray:
    b = b.as_np_ndarray() if isinstance(b, mx.nd.NDArray) else b
    return mx.np.bitwise_xor(a.as_np_ndarray(), b).as_nd_ndarray()


def uniforms(count: int, stream: int, step: int, ctx) -> mx.nd.NDArray:
    """``count`` float64 numbers in [0, 1): element ``j`` is a hash of (stream, step, j),
    the same on every process that asks for the same arguments."""
    key_a = _hash32_host(stream ^ 0x9E3779B9)
    key_b = _hash32_host((step * 0x85EBCA6B + stream) & _MASK32) ^ _hash32_host(step >> 32)
    x = mx.nd.arange(0, count, ctx=ctx, dtype="int64")
    x = _hash32(_xor(x, key_a))
    x = _hash32(_xor(x, key_b))
    return x.astype("float64") / float(1 << 32)


# ------------------------------------------------------------------ packing
_POWERS: dict = {}


def _powers(width: int, ctx) -> mx.nd.NDArray:
    """2**(width * j) for the fields j of a word, float32 (made once per width and
    device)."""
    found = _POWERS.get((width, ctx))
    if found is None:
        found = _POWERS[(width, ctx)] = mx.nd.array(
            [2.0 ** (width * j) for j in range(_WORD_BITS // width)], ctx=ctx,
            dtype="float32")
    return found


def _pack(codes: mx.nd.NDArray, width: int) -> mx.nd.NDArray:
    """Non-negative integer codes (float32, < 2**width), ``24 // width`` per float32
    word: element ``i`` is field ``i % per_word`` of word ``i // per_word``."""
    per_word = _WORD_BITS // width
    words = -(-codes.size // per_word)
    padded = mx.nd.zeros((words * per_word,), ctx=codes.context, dtype="float32")
    padded[:codes.size] = codes
    weights = _powers(width, codes.context)
    return mx.nd.broadcast_mul(padded.reshape((words, per_word)),
                               weights.reshape((1, per_word))).sum(axis=1)


def _unpack(words: mx.nd.NDArray, width: int, size: int) -> mx.nd.NDArray:
    """The codes of rows of packed words: (rows, words) -> (rows, size), float32."""
    per_word = _WORD_BITS // width
    rows = words.shape[0]
    shifts = _powers(width, words.context).reshape((1, 1, per_word))
    shifted = mx.nd.floor(mx.nd.broadcast_div(words.reshape((rows, -1, 1)), shifts))
    fields = shifted - mx.nd.floor(shifted / float(1 << width)) * float(1 << width)
    return fields.reshape((rows, -1))[:, :size]


_ONES: dict = {}


def _sum64(x: mx.nd.NDArray) -> mx.nd.NDArray:
    """The sum of ``x``'s elements accumulated in float64, shape (1,), as BytePS sums in
    double (a dot product with ones: MXNet's float64 reduction is several times
    slower)."""
    key = (x.size, x.context)
    ones = _ONES.get(key)
    if ones is None:
        ones = _ONES[key] = mx.nd.ones((x.size,), ctx=x.context, dtype="float64")
    return mx.nd.dot(x.reshape((-1,)).astype("float64"), ones).reshape((1,))


def _allgather(kv, key: str, part: mx.nd.NDArray, priority: int) -> mx.nd.NDArray:
    """Every worker's ``part`` (same shape on all), stacked in rank order, through the
    backend's sum: this worker's row of a zero buffer, summed."""
    rows = mx.nd.zeros((kv.num_workers,) + part.shape, ctx=part.context, dtype=part.dtype)
    rows[kv.rank] = part
    kv.pushpull(key, rows, priority=priority)
    return rows


# ------------------------------------------------------------------ the codecs
_ARRAY_FIELDS = ("momentum", "error", "server_error", "nag")


class _TensorState:
    """One tensor's state: this worker's momentum and error, and the server's error and
    Nesterov momentum (identical on every worker), its step count (the random draws'
    counter) and the learning rate of its last step (the error feedback's ratio)."""

    def __init__(self):
        self.momentum: mx.nd.NDArray | None = None
        self.error: mx.nd.NDArray | None = None
        self.server_error: mx.nd.NDArray | None = None
        self.nag: mx.nd.NDArray | None = None
        self.steps = 0
        self.last_lr: float | None = None

    def on(self, ctx) -> _TensorState:
        """The arrays on ``ctx`` (a checkpoint restores them to the CPU)."""
        for field in ("momentum", "error", "server_error", "nag"):
            value = getattr(self, field)
            if value is not None and value.context != ctx:
                setattr(self, field, value.as_in_context(ctx))
        return self


class BytePSCompressor(Codec):
    """Common part of BytePS's compressors: error feedback, momentum, the server's
    turn, state. Subclasses define ``_compress(p, stream, step)`` -> (message, what it
    decompresses to) and ``_decompress_rows(message rows)`` -> dense rows, and how the
    message travels."""

    name = "byteps"
    # this worker's momentum and error are its own; the server's are every worker's
    _private_fields = ("momentum", "error")

    def __init__(self, ef: Any = None, momentum: Any = None, momentum_mu: Any = None,
                 seed: Any = None, min_compress_bytes: Any = None,
                 momentum_uncompressed: bool = True):
        if _flag(ef) and ef != "vanilla":
            raise ValueError(f"compression parameter 'ef' must be 'vanilla' (BytePS's error "
                             f"feedback) or empty, got {ef!r}")
        if _flag(momentum) and momentum != "nesterov":
            raise ValueError(f"compression parameter 'momentum' must be 'nesterov' or empty, "
                             f"got {momentum!r}")
        self.ef = "vanilla" if _flag(ef) else None
        self.momentum = "nesterov" if _flag(momentum) else None
        self.momentum_mu = None
        if self.momentum:
            if momentum_mu is None:
                raise ValueError("momentum='nesterov' needs 'momentum_mu' (BytePS takes it "
                                 "from the optimizer's momentum)")
            self.momentum_mu = check_number("momentum_mu", momentum_mu, 0)
        self.seed = None
        if seed is not None and seed is not False and seed != 0:
            self.seed = check_number("seed", seed, 0, integer=True)
        if min_compress_bytes is None:
            min_compress_bytes = int(os.environ.get("BYTEPS_MIN_COMPRESS_BYTES", 65536))
        self.min_compress_bytes = check_number("min_compress_bytes", min_compress_bytes, 0,
                                               integer=True)
        self.momentum_uncompressed = bool(momentum_uncompressed)
        self.params = {"ef": self.ef, "momentum": self.momentum,
                       "momentum_mu": self.momentum_mu, "seed": self.seed,
                       "min_compress_bytes": self.min_compress_bytes,
                       "momentum_uncompressed": self.momentum_uncompressed}
        self._states: dict[Any, _TensorState] = {}
        self._lr: float | None = None
        # unseeded: this worker's own stream (drawn once per process)
        self._worker_stream = self.seed if self.seed is not None \
            else int.from_bytes(os.urandom(4), "little")
        self._server_stream = self.seed if self.seed is not None else _SERVER_SALT

    def set_learning_rate(self, lr: float) -> None:
        """The learning rate of the coming step: error feedback scales the kept error by
        ``lr_previous / lr`` (BytePS's trainer passes it through its ``lr.s`` file)."""
        self._lr = float(lr)

    # ------------------------------------------------------------ the step
    def reduce(self, kv, indices, keys, grads, priority) -> None:
        plain_keys, plain, small = [], [], []
        for index, key, grad in zip(indices, keys, grads):
            nbytes = grad.size * np.dtype(grad.dtype).itemsize
            if nbytes < self.min_compress_bytes:
                plain_keys.append(key)
                plain.append(grad)
                small.append(index)
            else:
                self._reduce_compressed(kv, index, key, grad, priority)
        plain_sum(kv, plain_keys, plain, priority)
        if self.momentum and self.momentum_uncompressed:
            for index, grad in zip(small, plain):
                self._nesterov_after_sum(index, grad)

    def _state(self, index) -> _TensorState:
        state = self._states.get(index)
        if state is None:
            state = self._states[index] = _TensorState()
        return state

    def _ratio(self, state: _TensorState) -> float:
        lr, last = self._lr, state.last_lr
        state.last_lr = lr
        return 1.0 if lr is None or last is None or lr == 0 else last / lr

    def _reduce_compressed(self, kv, index, key, grad, priority) -> None:
        state = self._state(index).on(grad.context)
        g = grad.reshape((-1,))
        ratio = self._ratio(state) if self.ef else 1.0
        # 1-2: momentum, then the error kept from the last step
        p = g
        if self.momentum:
            mu = self.momentum_mu
            state.momentum = g.copy() if state.momentum is None else g + mu * state.momentum
            p = g + mu * state.momentum
        if self.ef and state.error is not None:
            p = p + ratio * state.error if ratio != 1.0 else p + state.error
        # 3: this worker's message
        step = state.steps
        message, sent = self._compress(p, self._worker_stream, step)
        if self.ef:
            state.error = p - sent
        # 4: every worker's message, decompressed and summed as the server does
        rows = self._gather(kv, key, message, priority)
        dense = self._decompress_rows(rows, g)
        total = mx.nd.add_n(*[dense[i] for i in range(dense.shape[0])])
        # 5: the server compresses the sum for the reply
        q = total
        if self.ef and state.server_error is not None:
            q = q + ratio * state.server_error if ratio != 1.0 else q + state.server_error
        _, result = self._compress(q, self._server_stream, step, pack=False)
        if self.ef:
            state.server_error = q - result
        state.steps = step + 1
        grad[:] = result.reshape(grad.shape)

    def _nesterov_after_sum(self, index, grad) -> None:
        state = self._state(index).on(grad.context)
        if state.nag is None:
            state.nag = mx.nd.zeros_like(grad)
        state.nag += grad
        state.nag *= self.momentum_mu
        grad += state.nag

    # ------------------------------------------------------------ subclasses
    def _compress(self, p: mx.nd.NDArray, stream: int, step: int, pack: bool = True) -> tuple:
        """(message, what it decompresses to); the server's reply is only decompressed
        here (``pack=False``: no message)."""
        raise NotImplementedError

    def _decompress_rows(self, rows: tuple, like: mx.nd.NDArray) -> mx.nd.NDArray:
        raise NotImplementedError

    def _gather(self, kv, key: str, message: tuple, priority: int) -> tuple:
        return tuple(_allgather(kv, f"{key}.{self.name}{i}", part, priority)
                     for i, part in enumerate(message))

    # ------------------------------------------------------------ state
    def local_state(self) -> dict:
        return {"momentum": self._collect("momentum"), "error": self._collect("error")}

    def shared_state(self) -> dict:
        return {"server_error": self._collect("server_error"), "nag": self._collect("nag"),
                "steps": {i: s.steps for i, s in self._states.items()},
                "last_lr": {i: s.last_lr for i, s in self._states.items()}}

    def state_arrays(self) -> dict[str, mx.nd.NDArray]:
        return {f"{field}.{i}": getattr(s, field) for i, s in self._states.items()
                for field in _ARRAY_FIELDS if getattr(s, field) is not None}

    def state_counters(self) -> dict:
        layout = [(field, i, tuple(a.shape), np.dtype(a.dtype).name)
                  for i, s in self._states.items() for field in _ARRAY_FIELDS
                  if (a := getattr(s, field)) is not None]
        return {"layout": layout,
                "counters": {i: (s.steps, s.last_lr) for i, s in self._states.items()}}

    def set_state_counters(self, saved: dict, ctx_of) -> None:
        wanted = {(field, i): (shape, dtype) for field, i, shape, dtype in saved["layout"]}
        self._states = {i: self._states.get(i) or _TensorState() for i in saved["counters"]}
        for i, state in self._states.items():
            state.steps, state.last_lr = saved["counters"][i]
            for field in _ARRAY_FIELDS:
                if (field, i) not in wanted:
                    setattr(state, field, None)
                elif getattr(state, field) is None:
                    shape, dtype = wanted[(field, i)]
                    setattr(state, field, mx.nd.zeros(shape, ctx=ctx_of(i), dtype=dtype))

    def _collect(self, field: str) -> dict:
        return {i: getattr(s, field).asnumpy() for i, s in self._states.items()
                if getattr(s, field) is not None}

    def load_state(self, shared: dict, local: dict) -> None:
        self._states = {}
        for field, source in (("momentum", local), ("error", local),
                              ("server_error", shared), ("nag", shared)):
            for index, value in source.get(field, {}).items():
                setattr(self._state(index), field, mx.nd.array(value, dtype=value.dtype))
        for index, steps in shared.get("steps", {}).items():
            self._state(index).steps = int(steps)
        for index, lr in shared.get("last_lr", {}).items():
            self._state(index).last_lr = lr


def _require_k(name: str, k) -> None:
    if k is None:
        raise ValueError(f"the {name} compressor needs 'k' (BytePS has no default), e.g. "
                         f"{{'type': {name!r}, 'k': {0.01 if name != 'dithering' else 4}}}")


def _k_of(k, size: int) -> int:
    """BytePS's ``k``: below 1 a fraction of the elements (at least 1), else a count."""
    return max(1, int(k * size)) if k < 1 else int(k)


class OneBit(BytePSCompressor):
    """BytePS's ``onebit`` compressor (signSGD with majority vote, Bernstein et al.,
    2018): the signs of the gradient, scaled by ``mean(|g|)`` with ``scaling=True``.
    See :mod:`dist_gluon.compression.byteps_compressors` for the whole step.

    Parameters
    ----------
    scaling : bool, default False
        Scale the signs by the mean magnitude (else by 1).
    ef : 'vanilla' or None
        Error feedback on the workers and on the (emulated) server.
    momentum : 'nesterov' or None
        Nesterov momentum before compression, with ``momentum_mu``.
    momentum_mu : float
    seed : int, optional
        Accepted by every compressor, used by randomk and dithering.
    min_compress_bytes : int, default $BYTEPS_MIN_COMPRESS_BYTES or 65536
        Smaller tensors travel uncompressed.
    momentum_uncompressed : bool, default True
        Nesterov momentum (after the sum) on the tensors that travel uncompressed.
    """

    name = "onebit"

    def __init__(self, scaling: Any = False, ef=None, momentum=None, momentum_mu=None,
                 seed=None, min_compress_bytes=None, momentum_uncompressed=True):
        super().__init__(ef, momentum, momentum_mu, seed, min_compress_bytes,
                         momentum_uncompressed)
        if isinstance(scaling, str):      # BytePS passes it on as str(bool)
            scaling = scaling.lower() in ("true", "1")
        self.scaling = bool(scaling)
        self.params = {"scaling": self.scaling, **self.params}
        self._buffers: dict = {}

    def _reduce_compressed(self, kv, index, key, grad, priority) -> None:
        if not _kernels.serves(grad.dtype, grad.context):
            super()._reduce_compressed(kv, index, key, grad, priority)
            return
        # the same step in two fused kernels (dist_gluon._kernels), state kept from zeros
        state = self._state(index).on(grad.context)
        g = grad.reshape((-1,))
        ratio = self._ratio(state) if self.ef else 1.0
        if self.momentum and state.momentum is None:
            state.momentum = mx.nd.zeros_like(g)
        if self.ef and state.error is None:
            state.error = mx.nd.zeros_like(g)
        if self.ef and state.server_error is None:
            state.server_error = mx.nd.zeros_like(g)
        flags = {"ef": int(bool(self.ef)), "ratio": ratio, "scaling": int(self.scaling)}
        message, = _kernels.push(
            "dg_onebit_worker",
            [g, state.momentum if self.momentum else self._scratch(g, "momentum"),
             state.error if self.ef else self._scratch(g, "p")],
            [((-(-g.size // _WORD_BITS) + 1,), "float32")], priority,
            momentum=int(bool(self.momentum)), mu=self.momentum_mu or 0.0, **flags)
        rows = self._gather(kv, key, message, priority)
        _kernels.push(
            "dg_onebit_server",
            [rows, state.server_error if self.ef else self._scratch(g, "server")], [g],
            priority, size=g.size, dtype=np.dtype(g.dtype).name, **flags)
        state.steps += 1

    def _scratch(self, like: mx.nd.NDArray, role: str) -> mx.nd.NDArray:
        """A buffer of ``like``'s size for a kernel's unused state (no momentum or no
        error feedback), one per role, size, dtype and device."""
        key = (role, like.size, np.dtype(like.dtype).name, like.context)
        if key not in self._buffers:
            self._buffers[key] = mx.nd.zeros((like.size,), ctx=like.context,
                                             dtype=like.dtype)
        return self._buffers[key]

    def _compress(self, p, stream, step, pack=True):
        negative = (p < 0).astype("float32")
        if self.scaling:
            scale = (_sum64(mx.nd.abs(p)) / p.size).astype("float32")
        else:
            scale = mx.nd.ones((1,), ctx=p.context, dtype="float32")
        # what the receiver unpacks, computed from the signs directly
        sent = mx.nd.broadcast_mul(1.0 - 2.0 * negative, scale.reshape((1,)))
        message = mx.nd.concat(_pack(negative, 1), scale.reshape((1,)), dim=0) \
            if pack else None
        return message, sent.astype(p.dtype, copy=False)

    def _decompress_rows(self, rows, like):
        bits = _unpack(rows[:, :-1], 1, like.size)
        values = mx.nd.broadcast_mul(1.0 - 2.0 * bits, rows[:, -1].reshape((-1, 1)))
        return values.astype(like.dtype, copy=False)

    def _gather(self, kv, key, message, priority):
        # the signs' words, then the scale: one message, one collective
        return _allgather(kv, f"{key}.onebit", message, priority)


class _Sparse(BytePSCompressor):
    """topk and randomk: ``k`` (index, value) pairs."""

    def __init__(self, k=None, ef=None, momentum=None, momentum_mu=None, seed=None,
                 min_compress_bytes=None, momentum_uncompressed=True):
        super().__init__(ef, momentum, momentum_mu, seed, min_compress_bytes,
                         momentum_uncompressed)
        _require_k(self.name, k)
        self.k = check_number("k", k, 0, strict=True)
        self.params = {"k": self.k, **self.params}

    def _count(self, size: int) -> int:
        k = _k_of(self.k, size)
        if k > size // 2:
            raise ValueError(f"{self.name}: k={self.k} selects {k} of a tensor's {size} "
                             f"elements; BytePS requires at most half (k <= {size // 2})")
        return k

    def _indices(self, p, stream, step) -> mx.nd.NDArray:
        raise NotImplementedError

    def _compress(self, p, stream, step, pack=True):
        # indices travel as float32 (exact below 2**24 elements), else float64
        index_dtype = "float32" if p.size <= 1 << 24 else "float64"
        indices = self._indices(p, stream, step)
        message = (indices.astype(index_dtype), mx.nd.take(p, indices.astype("int64")))
        sent = self._decompress_rows(tuple(part.expand_dims(0) for part in message), p)[0]
        return message, sent

    def _decompress_rows(self, rows, like):
        indices, values = rows
        dense = [mx.nd.scatter_nd(values[r], indices[r].reshape((1, -1)), shape=(like.size,))
                 for r in range(indices.shape[0])]
        return mx.nd.stack(*dense, axis=0) if len(dense) > 1 else dense[0].expand_dims(0)


class TopK(_Sparse):
    """BytePS's ``topk`` compressor: the ``k`` elements of largest magnitude (``k`` < 1:
    that fraction of the elements). See :class:`OneBit` for ``ef``, ``momentum``."""

    name = "topk"

    def _indices(self, p, stream, step):
        k = self._count(p.size)
        return mx.nd.topk(mx.nd.abs(p), k=k, ret_typ="indices", dtype="float64")


class RandomK(_Sparse):
    """BytePS's ``randomk`` compressor: ``k`` elements drawn uniformly with replacement
    (the same ones on every worker and the server with ``seed``). See :class:`OneBit`."""

    name = "randomk"

    def _indices(self, p, stream, step):
        k = self._count(p.size)
        return mx.nd.floor(uniforms(k, stream, step, p.context) * p.size)


class Dithering(BytePSCompressor):
    """BytePS's ``dithering`` compressor (Horváth et al., 2019): stochastic rounding of
    ``|g| / scale`` to ``k`` levels, linear or natural (powers of two).

    Parameters
    ----------
    k : int
        Number of levels (BytePS's ``s``), at least 1.
    partition : 'linear' (default) or 'natural'
    normalize : 'max' (default) or 'l2'
    seed : int, optional
        Every worker and the server draw the same random numbers.
    """

    name = "dithering"

    def __init__(self, k=None, partition=None, normalize=None, ef=None, momentum=None,
                 momentum_mu=None, seed=None, min_compress_bytes=None,
                 momentum_uncompressed=True):
        super().__init__(ef, momentum, momentum_mu, seed, min_compress_bytes,
                         momentum_uncompressed)
        _require_k(self.name, k)
        self.k = check_number("k", k, 1, integer=True)
        partition = partition or "linear"
        normalize = normalize or "max"
        if partition not in ("linear", "natural"):
            raise ValueError(f"compression parameter 'partition' must be 'linear' or "
                             f"'natural', got {partition!r}")
        if normalize not in ("max", "l2"):
            raise ValueError(f"compression parameter 'normalize' must be 'max' or 'l2', got "
                             f"{normalize!r}")
        self.partition, self.normalize = partition, normalize
        # the denominator of a decoded level: k (linear) or 2**(k-1) (natural)
        self._levels = float(self.k if partition == "linear" else 1 << (self.k - 1))
        # a signed level (linear) or signed exponent + 1 (natural), shifted to 0..2k
        self._width = (2 * self.k).bit_length()
        if self._width > _WORD_BITS:
            raise ValueError(f"dithering: k={self.k} levels do not fit a {_WORD_BITS}-bit "
                             "word")
        self.params = {"k": self.k, "partition": partition, "normalize": normalize,
                       **self.params}

    def _compress(self, p, stream, step, pack=True):
        # BytePS takes each |p| as a float, the scale as a double (a float on the wire)
        magnitude = mx.nd.abs(p).astype("float32").astype("float64")
        if self.normalize == "max":
            scale = mx.nd.abs(p).max().astype("float64")        # a max is exact
        else:
            scale = mx.nd.sqrt(_sum64(mx.nd.square(p)))
        # an all-zero tensor (a rank that left a dg.Join loop, a frozen branch) has scale
        # 0: its levels are 0, never 0 / 0
        ratio = mx.nd.broadcast_div(magnitude, mx.nd.maximum(scale, 1e-300))
        u = uniforms(p.size, stream, step, p.context)
        if self.partition == "linear":
            x = (ratio * self.k).astype("float32").astype("float64")
            low = mx.nd.floor(x)
            level = low + (u < (x - low))
            code = level
        else:
            x = ratio * float(1 << (self.k - 1))
            ceil = mx.nd.ceil(x)
            # the power of two at or below x: 0 for x <= 1
            low = mx.nd.where(ceil > 1, mx.nd.power(2.0, mx.nd.ceil(mx.nd.log2(
                mx.nd.maximum(ceil, 1.0))) - 1), mx.nd.zeros_like(x))
            length = mx.nd.maximum(low, 1.0)
            level = low + length * (u < (x - low) / length)
            code = mx.nd.where(level > 0, mx.nd.log2(mx.nd.maximum(level, 1.0)) + 1,
                               mx.nd.zeros_like(level))
        signed = mx.nd.where(p < 0, -code, code) + self.k
        scale = scale.astype("float32")
        # what the receiver decodes: the same float32 arithmetic as _decompress_rows
        magnitude = mx.nd.broadcast_mul(level.astype("float32"), scale) / self._levels
        sent = mx.nd.where(p < 0, -magnitude, magnitude).astype(p.dtype, copy=False)
        message = (_pack(signed.astype("float32"), self._width), scale) if pack else None
        return message, sent

    def _decompress_rows(self, rows, like):
        words, scales = rows
        signed = _unpack(words, self._width, like.size) - self.k
        code = mx.nd.abs(signed)
        if self.partition == "linear":
            level = code
        else:
            level = mx.nd.where(code > 0, mx.nd.power(2.0, code - 1), mx.nd.zeros_like(code))
        magnitude = mx.nd.broadcast_mul(level, scales.reshape((-1, 1))) / self._levels
        values = mx.nd.where(signed < 0, -magnitude, magnitude)
        return values.astype(like.dtype, copy=False)

    def _gather(self, kv, key, message, priority):
        words, scale = message
        rows = _allgather(kv, f"{key}.dithering", mx.nd.concat(words, scale, dim=0),
                          priority)
        return rows[:, :-1], rows[:, -1]
