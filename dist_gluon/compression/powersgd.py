"""PowerSGD: low-rank gradient compression with error feedback (Vogels, Karimireddy and
Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
Optimization", NeurIPS 2019), as PyTorch's DDP communication hook does it.

Each matrix-shaped gradient (a conv kernel ``(out, in, kh, kw)`` is read as the matrix
``(out, in*kh*kw)``) ``M``, ``n x m``, plus this worker's error ``E``, is approximated
with rank ``r`` by one step of subspace iteration warm-started from the previous step's
``Q`` (``m x r``, the same on every worker):

    M = grad + E;  P = M Q;  P = sum over workers;  P = orthonormal basis of P
    Q = M^T P;  Q = sum over workers;  grad = P Q^T;  E = M - P Q^T / N

so two sums per step travel ``r (n + m)`` values instead of ``n m``. The tensors of a
step go in buckets of about 25 MB of gradient (PyTorch DDP's default), in backward order:
a bucket's P matrices travel in one collective, together with its uncompressed float32
tensors (vectors such as biases and BatchNorm parameters, and matrices too small to
gain), and its Q matrices in a second, so the last layers' sums start while the backward
pass of the first ones still runs. P is orthonormalised by a Householder LQ
factorisation of P^T in float64 (``linalg.gelqf``, batched over same-shape matrices;
numerically stable where Gram-Schmidt or Cholesky-QR in float32 is not), on the summed
P, which is the same on every worker. Everything runs in MXNet operators on the
gradient's context, queued on the engine: on the CPU the two passes over M that touch E
(``E += grad`` with ``P^T = Q^T M^T``, and ``grad = P Q^T`` with ``E -= P Q^T / N``) are
one fused kernel each (:mod:`dist_gluon._kernels`), elsewhere ``elemwise_add``, ``dot``
and ``linalg.gemm``; ``Q^T = P^T M`` is a ``dot`` and the basis ``gelqf``. E and Q stay
there, and become NumPy arrays only when Checkpointer asks for the state.
"""
from __future__ import annotations

import math

import mxnet as mx
import numpy as np

from .. import _kernels
from .base import Codec, check_number, plain_sum

# gradient elements per bucket (PyTorch DDP's 25 MB of float32): a bucket's P and Q
# travel in one sum each
_BUCKET_ELEMENTS = 25 * 2 ** 20 // 4


class PowerSGD(Codec):
    """Rank-``rank`` PowerSGD with error feedback and warm start.

    Parameters
    ----------
    rank : int, default 4
        Rank of the approximation (PyTorch's ``matrix_approximation_rank``); higher is
        more accurate and sends more. Capped at the smaller side of each matrix.
    warmup_steps : int, default 0
        Steps (per parameter) that send uncompressed gradients first (PyTorch's
        ``start_powerSGD_iter``); the paper's accuracy needs a few epochs of warm-up on
        some models.
    min_compression_rate : float, default 2.0
        A matrix is compressed only when ``n m >= rate * r (n + m)`` (PyTorch's name).
    min_size : int, default 0
        Tensors with fewer elements travel uncompressed.
    seed : int, default 0
        Seed of the initial Q matrices (the same on every worker).
    """

    name = "powersgd"
    _array_fields = {"error": "_errors", "qt": "_qt"}
    _counter_fields = ("_steps",)
    _private_fields = ("error",)

    def __init__(self, rank: int = 4, warmup_steps: int = 0,
                 min_compression_rate: float = 2.0, min_size: int = 0, seed: int = 0):
        self.rank = check_number("rank", rank, 1, integer=True)
        self.warmup_steps = check_number("warmup_steps", warmup_steps, 0, integer=True)
        self.min_compression_rate = check_number("min_compression_rate",
                                                 min_compression_rate, 0)
        self.min_size = check_number("min_size", min_size, 0, integer=True)
        self.seed = check_number("seed", seed, 0, integer=True)
        self.params = {"rank": self.rank, "warmup_steps": self.warmup_steps,
                       "min_compression_rate": self.min_compression_rate,
                       "min_size": self.min_size, "seed": self.seed}
        # state, on the gradient's context (NumPy arrays between load_state() and the
        # tensor's next step)
        self._steps: dict = {}      # index -> steps reduced (shared)
        self._qt: dict = {}         # index -> Q^T, r x m float32 (shared)
        self._q: dict = {}          # index -> Q, m x r, restored and not yet used
        self._errors: dict = {}     # index -> E, n x m float32 (this worker's)
        # bucket's first key -> _Layout: its sum buffers, reused every step
        self._layouts: dict = {}

    def matrix_shape(self, shape: tuple) -> tuple[int, int] | None:
        """The ``(n, m)`` a gradient of ``shape`` is compressed as, or None when it
        travels uncompressed."""
        if len(shape) < 2:
            return None
        n = int(shape[0])
        m = math.prod(shape[1:])
        r = min(self.rank, n, m)
        if n * m < max(self.min_size, 1) or n * m < self.min_compression_rate * r * (n + m):
            return None
        return n, m

    def reduce(self, kv, indices, keys, grads, priority) -> None:
        plain, entries = [], []
        for index, key, grad in zip(indices, keys, grads):
            steps = self._steps.get(index, 0)
            self._steps[index] = steps + 1
            shape = self.matrix_shape(grad.shape) if steps >= self.warmup_steps else None
            if shape is None and grad.dtype != np.float32:
                plain.append((key, grad))      # travels on its own
            else:
                entries.append((index, key, grad, shape))
        plain_sum(kv, [k for k, _ in plain], [g for _, g in plain], priority)
        if not any(shape for *_, shape in entries):
            plain_sum(kv, [k for _, k, _, _ in entries], [g for _, _, g, _ in entries],
                      priority)
            return
        # backward order, in buckets: the last layers' sums start while the backward
        # pass of the first ones still runs
        for bucket in _buckets(entries[::-1], _BUCKET_ELEMENTS):
            self._reduce_bucket(kv, bucket, priority)

    def _reduce_bucket(self, kv, entries: list, priority: int) -> None:
        """Steps 1-5 of the class docstring for one bucket: float32 tensors that travel
        whole ride with the P matrices."""
        key = entries[0][1]
        if all(isinstance(index, int) for index, *_ in entries):
            # as urgent as its first layer: the next forward pass needs it first
            priority = -min(index for index, *_ in entries)
        if not any(shape for *_, shape in entries):
            plain_sum(kv, [k for _, k, _, _ in entries], [g for _, _, g, _ in entries],
                      priority)
            return
        ctx = entries[0][2].context
        signature = (ctx,) + tuple((index, grad.shape, shape)
                                   for index, _, grad, shape in entries)
        layout = self._layouts.get(key)
        if layout is None or layout.signature != signature:
            layout = self._layouts[key] = _Layout(signature, entries, self.rank)
        workers = kv.num_workers
        grads = [grad for _, _, grad, _ in entries]
        for position, view in layout.riders:
            grads[position].reshape((-1,)).copyto(view)
        fused = _kernels.serves(np.float32, ctx)
        matrices = []
        for item in layout.matrices:
            qt = self._initial_qt(item.index, item.m, item.r, ctx)
            # M = grad + E (held in E); P^T = Q^T M^T, straight into the sum's buffer
            matrices.append(self._project(item, grads[item.position], qt, fused, priority))
        kv.pushpull(f"{key}.psgd.P.{layout.p.size}", layout.p, priority=priority)
        for position, view in layout.riders:
            view.reshape(grads[position].shape).copyto(grads[position])
        bases = layout.orthonormal_rows()
        for item, m, basis in zip(layout.matrices, matrices, bases):
            # Q^T = P^T M
            mx.nd.dot(basis, m, out=item.qt)
        kv.pushpull(f"{key}.psgd.Q.{layout.qt.size}", layout.qt, priority=priority)
        for item, m, basis in zip(layout.matrices, matrices, bases):
            qt = self._qt[item.index]
            item.qt.copyto(qt)
            self._approximate(item, grads[item.position], m, basis, qt, workers, fused,
                              priority)

    def _project(self, item, grad, qt, fused: bool, priority: int) -> mx.nd.NDArray:
        """M = grad + E, held in this worker's error array (n x m, float32), and P^T =
        Q^T M^T into the bucket's P buffer: one pass over M on the fused kernel."""
        error = self._errors.get(item.index)
        if isinstance(error, np.ndarray) and error.shape == (item.n, item.m):
            error = mx.nd.array(error, ctx=grad.context, dtype="float32")
        elif isinstance(error, mx.nd.NDArray) and error.shape == (item.n, item.m):
            if error.context != grad.context:       # restored on the CPU
                error = error.as_in_context(grad.context)
        else:
            error = mx.nd.zeros((item.n, item.m), ctx=grad.context, dtype="float32")
        self._errors[item.index] = error
        g = grad.reshape((item.n, item.m))
        if grad.dtype != np.float32:
            g = mx.nd.Cast(g, dtype="float32")
        if fused:
            _kernels.push("dg_powersgd_project", [g, error, qt], [item.p], priority)
        else:
            mx.nd.elemwise_add(error, g, out=error)
            mx.nd.dot(qt, error, transpose_b=True, out=item.p)
        return error

    @staticmethod
    def _approximate(item, grad, m, basis, qt, workers: int, fused: bool,
                     priority: int) -> None:
        """grad = P Q^T; E = M - P Q^T / N (M is held in E): one pass on the fused
        kernel, one gemm on the operators."""
        target = grad.reshape((item.n, item.m))
        out = target if grad.dtype == np.float32 else None
        if fused:
            approx, = _kernels.push("dg_powersgd_approximate", [basis, qt, m],
                                    [out if out is not None else (m.shape, "float32")],
                                    priority, workers=workers)
        else:
            approx = mx.nd.dot(basis, qt, transpose_a=True, out=out)
            mx.nd.linalg.gemm(basis, qt, m, transpose_a=True, alpha=-1.0 / workers,
                              beta=1.0, out=m)
        if grad.dtype != np.float32:
            mx.nd.Cast(approx, dtype=grad.dtype, out=target)

    def _initial_qt(self, index, m: int, r: int, ctx) -> mx.nd.NDArray:
        """Q^T (r x m) on ``ctx``: the previous step's, a restored one, or a new one drawn
        from the seed (the same on every worker)."""
        qt = self._qt.get(index)
        if qt is not None and qt.shape == (r, m):
            if qt.context != ctx:                   # restored on the CPU
                qt = self._qt[index] = qt.as_in_context(ctx)
            return qt
        q = self._q.pop(index, None)        # restored by load_state, m x r
        if q is None or q.shape != (m, r):
            seed = (self.seed * 1000003 + hash_index(index)) % (1 << 32)
            q = np.random.RandomState(seed).standard_normal((m, r)).astype(np.float32)
        qt = self._qt[index] = mx.nd.array(np.ascontiguousarray(q.T), ctx=ctx,
                                           dtype="float32")
        return qt

    def state_arrays(self) -> dict[str, mx.nd.NDArray]:
        # a Q restored by load_state and not used yet becomes its Q^T
        for index, q in self._q.items():
            self._qt[index] = mx.nd.array(np.ascontiguousarray(q.T), dtype="float32")
        self._q = {}
        return super().state_arrays()

    def shared_state(self) -> dict:
        q = {index: qt.asnumpy().T for index, qt in self._qt.items()}
        return {"steps": dict(self._steps), "q": {**self._q, **q}}

    def local_state(self) -> dict:
        return {"errors": _to_numpy(self._errors)}

    def load_state(self, shared: dict, local: dict) -> None:
        self._steps = dict(shared.get("steps", {}))
        self._q = {k: np.array(v, dtype=np.float32) for k, v in shared.get("q", {}).items()}
        self._qt = {}
        self._errors = {k: np.array(v, dtype=np.float32)
                        for k, v in local.get("errors", {}).items()}


def _to_numpy(arrays: dict) -> dict:
    return {k: v.asnumpy() if isinstance(v, mx.nd.NDArray) else v for k, v in arrays.items()}


def hash_index(index) -> int:
    """A number for a parameter index that is the same in every process (Python's
    hash() of a str is salted per process)."""
    if isinstance(index, (int, np.integer)):
        return int(index)
    return sum((i + 1) * ord(c) for i, c in enumerate(str(index)))


def _buckets(entries: list, limit: int) -> list[list]:
    """``entries`` cut into runs of about ``limit`` gradient elements (the last tensor
    of a run may pass it), in their order."""
    buckets, current, size = [], [], 0
    for entry in entries:
        current.append(entry)
        size += entry[2].size
        if size >= limit:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


class _Matrix:
    """One compressed gradient of a bucket (at ``position`` in it): its ``n x m``
    matrix of rank ``r``, and its views into the bucket's P (``r x n``, as P^T) and Q
    (``r x m``, as Q^T) buffers."""

    def __init__(self, position: int, index, n: int, m: int, r: int):
        self.position, self.index, self.n, self.m, self.r = position, index, n, m, r
        self.p = self.qt = None


class _Layout:
    """The sum buffers of one bucket, made once and reused every step (a key sent with a
    new array each step would wait for the previous one): P holds the riders (float32
    tensors sent whole) and then every P^T, grouped by shape so that the same-shape
    ones are orthonormalised in one batched call; Q holds every Q^T."""

    def __init__(self, signature: tuple, entries: list, rank: int):
        self.signature = signature
        ctx = signature[0]
        riders = [(position, grad.size)
                  for position, (_, _, grad, shape) in enumerate(entries) if shape is None]
        self.matrices = [_Matrix(position, index, n, m, min(rank, n, m))
                         for position, (index, _, _, shape) in enumerate(entries)
                         if shape is not None for n, m in [shape]]
        groups: dict = {}
        for item in self.matrices:
            groups.setdefault((item.r, item.n), []).append(item)
        p_size = sum(size for _, size in riders) + sum(i.r * i.n for i in self.matrices)
        q_size = sum(i.m * i.r for i in self.matrices)
        self.p = mx.nd.zeros((p_size,), ctx=ctx, dtype="float32")
        self.qt = mx.nd.zeros((q_size,), ctx=ctx, dtype="float32")
        offset = 0
        self.riders = []
        for position, size in riders:
            self.riders.append((position, self.p[offset:offset + size]))
            offset += size
        # (views of a group's P^T stacked as k x r x n, its matrices)
        self.groups = []
        q_offset = 0
        for (r, n), items in groups.items():
            start = offset
            for item in items:
                item.p = self.p[offset:offset + r * n].reshape((r, n))
                offset += r * n
                item.qt = self.qt[q_offset:q_offset + item.m * r].reshape((r, item.m))
                q_offset += item.m * r
            self.groups.append((self.p[start:offset].reshape((len(items), r, n)), items))
        self.matrices = [item for _, items in self.groups for item in items]

    def orthonormal_rows(self) -> list[mx.nd.NDArray]:
        """For every matrix, in ``self.matrices``' order, orthonormal rows spanning its
        summed P^T: a batched LQ factorisation (Householder, LAPACK gelqf) in float64
        per group of same-shape matrices. A zero P (a zero gradient) gets unit rows,
        and its matrix then approximates to zero."""
        bases = []
        for stacked, items in self.groups:
            rows, _ = mx.nd.linalg.gelqf(mx.nd.Cast(stacked, dtype="float64"))
            rows = mx.nd.Cast(rows, dtype="float32")
            bases.extend(rows[i] for i in range(len(items)))
        return bases
