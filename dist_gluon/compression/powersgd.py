"""PowerSGD: low-rank gradient compression with error feedback (Vogels, Karimireddy and
Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
Optimization", NeurIPS 2019), as PyTorch's DDP communication hook does it.

Each matrix-shaped gradient (a conv kernel ``(out, in, kh, kw)`` is read as the matrix
``(out, in*kh*kw)``) ``M``, ``n x m``, plus this worker's error ``E``, is approximated
with rank ``r`` by one step of subspace iteration warm-started from the previous step's
``Q`` (``m x r``, the same on every worker):

    M = grad + E;  P = M Q;  P = sum over workers;  P = orthonormal basis of P
    Q = M^T P;  Q = sum over workers;  grad = P Q^T;  E = M - P Q^T / N

so two sums per step travel ``r (n + m)`` values instead of ``n m``. Every P of a step
travels in one collective, together with the uncompressed tensors (vectors such as
biases and BatchNorm parameters, and matrices too small to gain), and every Q in a
second. P is orthonormalised by a Householder QR in float64 (numerically stable where
Gram-Schmidt in float32 is not), on the summed P, which is the same on every worker.
"""
from __future__ import annotations

import mxnet as mx
import numpy as np

from .base import Codec, check_number, plain_sum


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
        self._steps: dict = {}      # index -> steps reduced (shared)
        self._q: dict = {}          # index -> Q, m x r float32 (shared)
        self._errors: dict = {}     # index -> E, n x m (this worker's)

    def matrix_shape(self, shape: tuple) -> tuple[int, int] | None:
        """The ``(n, m)`` a gradient of ``shape`` is compressed as, or None when it
        travels uncompressed."""
        if len(shape) < 2:
            return None
        n = int(shape[0])
        m = int(np.prod(shape[1:]))
        r = min(self.rank, n, m)
        if n * m < max(self.min_size, 1) or n * m < self.min_compression_rate * r * (n + m):
            return None
        return n, m

    def reduce(self, kv, indices, keys, grads, priority) -> None:
        workers = kv.num_workers
        plain, compressed = [], []
        for index, key, grad in zip(indices, keys, grads):
            steps = self._steps.get(index, 0)
            self._steps[index] = steps + 1
            shape = self.matrix_shape(grad.shape) if steps >= self.warmup_steps else None
            if shape is None:
                plain.append((key, grad))
            else:
                compressed.append((index, grad, shape))
        if not compressed:
            plain_sum(kv, [k for k, _ in plain], [g for _, g in plain], priority)
            return
        # float32 tensors that travel whole ride with the P matrices; others on their own
        riders = [g for _, g in plain if g.dtype == np.float32]
        others = [(k, g) for k, g in plain if g.dtype != np.float32]
        plain_sum(kv, [k for k, _ in others], [g for _, g in others], priority)

        matrices, ps = [], []
        for index, grad, (n, m) in compressed:
            matrix = grad.asnumpy().reshape(n, m).astype(np.float32, copy=False)
            error = self._errors.get(index)
            if error is not None and error.shape == matrix.shape:
                matrix = matrix + error
            q = self._initial_q(index, m, min(self.rank, n, m))
            matrices.append(matrix)
            ps.append(matrix @ q)
        head = keys[0]
        sums = self._sum(kv, f"{head}.psgd.P", [g.asnumpy() for g in riders] + ps, priority)
        for grad, total in zip(riders, sums):
            grad[:] = total.reshape(grad.shape)
        ps = [_orthonormal(p) for p in sums[len(riders):]]
        qs = self._sum(kv, f"{head}.psgd.Q", [mt.T @ p for mt, p in zip(matrices, ps)],
                       priority)
        for (index, grad, _), matrix, p, q in zip(compressed, matrices, ps, qs):
            approx = p @ q.T
            self._q[index] = q
            self._errors[index] = matrix - approx / np.float32(workers)
            grad[:] = approx.reshape(grad.shape).astype(grad.dtype, copy=False)

    def _initial_q(self, index, m: int, r: int) -> np.ndarray:
        q = self._q.get(index)
        if q is None or q.shape != (m, r):
            seed = (self.seed * 1000003 + hash_index(index)) % (1 << 32)
            q = np.random.RandomState(seed).standard_normal((m, r)).astype(np.float32)
            self._q[index] = q
        return q

    @staticmethod
    def _sum(kv, key: str, arrays: list[np.ndarray], priority: int) -> list[np.ndarray]:
        """The sums over the workers of ``arrays`` (float32), in one collective."""
        sizes = [a.size for a in arrays]
        flat = np.concatenate([a.reshape(-1).astype(np.float32, copy=False) for a in arrays])
        wire = mx.nd.array(flat, dtype="float32")
        # the buffer's length is part of the key: a ps-lite key keeps its first shape
        kv.pushpull(f"{key}.{flat.size}", wire, priority=priority)
        total = wire.asnumpy()
        out, start = [], 0
        for a, size in zip(arrays, sizes):
            out.append(total[start:start + size].reshape(a.shape))
            start += size
        return out

    def shared_state(self) -> dict:
        return {"steps": dict(self._steps), "q": dict(self._q)}

    def local_state(self) -> dict:
        return {"errors": dict(self._errors)}

    def load_state(self, shared: dict, local: dict) -> None:
        self._steps = dict(shared.get("steps", {}))
        self._q = {k: np.array(v) for k, v in shared.get("q", {}).items()}
        self._errors = {k: np.array(v) for k, v in local.get("errors", {}).items()}


def hash_index(index) -> int:
    """A number for a parameter index that is the same in every process (Python's
    hash() of a str is salted per process)."""
    if isinstance(index, (int, np.integer)):
        return int(index)
    return sum((i + 1) * ord(c) for i, c in enumerate(str(index)))


def _orthonormal(p: np.ndarray) -> np.ndarray:
    """An orthonormal basis of the columns of ``p`` (n x r), by QR in float64."""
    q, _ = np.linalg.qr(p.astype(np.float64))
    return q.astype(np.float32)
