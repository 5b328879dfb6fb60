"""SyncBatchNorm: batch normalisation with the statistics of every worker's samples.

With ``gluon.nn.BatchNorm`` each worker normalises with its own batch's mean and
variance, so N workers on B samples each do not train like one process on the N*B
samples, and the running statistics drift apart between ranks. ``SyncBatchNorm`` sums
the per-channel statistics over the workers instead: one collective per layer in the
forward pass (sums, squared sums and sample counts) and one in the backward pass (the
gradients of those sums). On one process it is ``nn.BatchNorm``.

The arithmetic on whole tensors is done by MXNet's own BatchNorm operator (its generic
reductions are 10-50 times slower on CPU); one autograd Function per layer, from the
input and gamma and beta to per-channel values, connects the workers. The forward
collective is issued from the training script's thread, in the order of the forward
pass. MXNet runs backward functions in its own custom-operator threads, in the order
its engine schedules them (independent branches, e.g. a ResNet's shortcut, in either
order), so backward collectives may be issued in a different order on each rank; every
key is used by exactly one layer, and the backends match collectives by key. Those
threads may also run a layer's backward functions of two micro-batches of one step
(``grad_req='add'``) in either order, so each recorded forward of a layer within a step
has a backward key (and arrays) of its own: the n-th micro-batch's gradients are summed
with the other ranks' n-th, whichever runs first.

The sums go over direct connections between the workers (dist_gluon/sidechannel.py:
neither horovod's cycle nor a queue behind the trainer's gradients) where the job allows
(not elastic, horovod/dist_sync/p3, one CPU device per worker, ``DG_SYNCBN_SIDE`` not 0),
else through the backend's ``pushpull``; the same arrays and keys either way. With the
side channel, compiled code (``_sidesum.cc``) queues the layer's forward operators and
runs its backward callback (``DG_SYNCBN_NATIVE=0``: the Python ones below), the same
operators on the same arrays.
"""
from __future__ import annotations

import ctypes
import itertools
import os
import threading
import traceback

import mxnet as mx
import numpy as np
from mxnet import autograd
from mxnet.gluon import nn

from . import join as _join
from . import sidechannel, worker
from .backends import Backend, resolve

# Statistics gate the rest of the pass: send them before gradients (priority <= 0) and
# with the batch sizes (1).
_PRIORITY = 1
_layer_numbers = itertools.count()
# Steps the trainers of this process have ended (step_ended): a layer numbers its
# recorded forwards from 0 in each step, each number with its own backward collective.
_steps_ended = 0
# A script that steps no dist_gluon trainer numbers its forwards without end: the
# numbers wrap at this many (so many micro-batches of one step stay apart).
MICRO_BATCH_KEYS = 16


def step_ended() -> None:
    """A trainer's step (or update) ended on this rank, as on every rank: the next
    recorded forward of each layer is a step's first micro-batch."""
    global _steps_ended
    _steps_ended += 1

_HYBRIDIZE_HELP = (
    "dist_gluon.SyncBatchNorm cannot run in a hybridized graph when training on {n} "
    "workers: it sums its statistics over the workers with a collective issued from "
    "Python in every forward and backward pass, which a cached graph cannot call. Do not "
    "call hybridize() on a network that contains SyncBatchNorm (hybridize only blocks "
    "without it), or use gluon.nn.BatchNorm (each worker's own statistics). On one "
    "process SyncBatchNorm is nn.BatchNorm and may be hybridized.")


_AMP_HELP = (
    "dist_gluon.SyncBatchNorm cannot sum its statistics in float64 (horovod's exact sums) "
    "after mx.contrib.amp.init(): AMP makes every operator that meets a float64 "
    "statistic run in float64, which MXNet's MKLDNN operators cannot, and the layer "
    "would train wrong without an error. Use AMP with SyncBatchNorm on dist_sync or p3 "
    "(their float32 all-gather composes with it), or gluon.nn.BatchNorm (each worker's "
    "own statistics) on horovod.")


def _amp_initialized() -> bool:
    """Whether ``mx.contrib.amp.init()`` has rewritten MXNet's operator functions."""
    from mxnet.contrib.amp import amp
    return bool(getattr(amp, "_amp_initialized", False))


class SyncBatchNorm(nn.BatchNorm):
    """Batch normalisation whose statistics are those of all workers' samples together.

    In training mode (``autograd.record()``, or ``autograd.train_mode()``, with
    ``use_global_stats=False``), every worker normalises with the mean and the biased
    variance of the concatenation of all workers' batches, and the gradients flow
    through those global statistics, so N workers train exactly like one process with
    ``nn.BatchNorm`` on the concatenated samples, also when the workers' batch sizes
    differ. Each layer costs one collective of ``2 C + 1`` float64 numbers in the
    forward pass (on ps-lite, an all-gather of ``workers x (2 C + 1)`` float32 numbers)
    and one of ``2 C`` numbers in the backward pass (C channels), over direct
    connections between the workers where the job allows (docs/api.md) and else through
    the backend; the statistics are computed with MXNet operators on the input's device
    and nothing waits on the host.
    The running statistics are
    updated from the global mean and biased variance, ``running = momentum * running +
    (1 - momentum) * batch`` as in ``nn.BatchNorm``, identically on every rank, at each
    recorded training forward (``nn.BatchNorm`` updates them in its backward pass: the
    same for every training step). In inference it uses the running statistics and
    communicates nothing; on one process (``num_workers == 1``) it is ``nn.BatchNorm``
    and issues no collective.

    Arguments and parameters are those of ``gluon.nn.BatchNorm``, in the same order
    (gamma, beta, running_mean, running_var) and with the same names
    (``batchnorm0_gamma``...), so parameters saved from either load into the other.
    Gluon models that take a normalisation layer accept it directly
    (``norm_layer=dg.SyncBatchNorm``); :func:`convert_sync_batchnorm` converts the
    BatchNorm layers of an existing network.

    Every rank must run the same training forward and backward passes (the collectives
    are keyed by layer, numbered in the order of their first training forward). A layer
    is applied once per forward pass: the backward passes of two applications of one
    layer would share its key in an order that may differ between ranks. A network that
    contains SyncBatchNorm cannot be hybridized on more than one worker: ``hybridize()``
    raises a RuntimeError that says so.

    Parameters
    ----------
    axis : int, default 1
        The channel axis (1 for NCHW and for (N, C) inputs, 3 for NHWC).
    momentum : float, default 0.9
        Momentum of the running statistics, in [0, 1].
    epsilon : float, default 1e-5
        Added to the variance before its square root; positive.
    center : bool, default True
        Learn the offset ``beta``.
    scale : bool, default True
        Learn the scale ``gamma`` (False: gamma is fixed at 1).
    use_global_stats : bool, default False
        Normalise with the running statistics in training too (then nothing is
        communicated).
    beta_initializer, gamma_initializer : str or Initializer
        Default 'zeros' and 'ones'.
    running_mean_initializer, running_variance_initializer : str or Initializer
        Default 'zeros' and 'ones'.
    in_channels : int, default 0
        Number of channels; 0 defers it to the first forward.
    kv : backend, backend name or None
        The backend whose workers share statistics; None picks it from the environment
        (``dist_gluon.create()``) at the first forward.

    Examples
    --------
    >>> net = gluon.nn.HybridSequential()
    >>> net.add(gluon.nn.Conv2D(64, 3), dg.SyncBatchNorm(), gluon.nn.Activation('relu'))
    >>> from gluoncv.model_zoo import resnet50_v1b
    >>> net = resnet50_v1b(norm_layer=dg.SyncBatchNorm)
    >>> with autograd.record():
    ...     loss = loss_fn(net(data), label)
    >>> loss.backward()
    >>> trainer.step(data.shape[0])        # a DistributedTrainer
    """

    def __init__(self, axis: int = 1, momentum: float = 0.9, epsilon: float = 1e-5,
                 center: bool = True, scale: bool = True, use_global_stats: bool = False,
                 beta_initializer="zeros", gamma_initializer="ones",
                 running_mean_initializer="zeros", running_variance_initializer="ones",
                 in_channels: int = 0, kv=None, **kwargs):
        if not 0.0 <= momentum <= 1.0:
            raise ValueError(f"momentum must be in [0, 1], got {momentum}")
        if not epsilon > 0:
            raise ValueError(f"epsilon must be positive, got {epsilon}")
        super().__init__(axis=axis, momentum=momentum, epsilon=epsilon, center=center,
                         scale=scale, use_global_stats=use_global_stats,
                         beta_initializer=beta_initializer, gamma_initializer=gamma_initializer,
                         running_mean_initializer=running_mean_initializer,
                         running_variance_initializer=running_variance_initializer,
                         in_channels=in_channels, **kwargs)
        self._attach(kv)

    def _alias(self) -> str:
        # parameter names as nn.BatchNorm's (batchnorm0_gamma...): checkpoints saved by
        # name load into either
        return "batchnorm"

    def _attach(self, kv) -> None:
        """Set the state a SyncBatchNorm adds to a BatchNorm (also for a converted one)."""
        if kv is not None and not isinstance(kv, (str, Backend)):
            resolve(kv)     # raises the TypeError that names what kv may be
        self._kv_spec = kv
        self._kv: Backend | None = None
        self._name: str | None = None
        self._comms: dict = {}          # context -> _Channel
        # over the devices: (forward _Meeting, {micro-batch: backward _Meeting})
        self._meetings: tuple | None = None
        self._round: int | None = None  # the job's round the channels were made in

    @property
    def kv(self) -> Backend:
        """The backend whose workers share statistics."""
        if self._kv is None:
            self._kv = resolve(self._kv_spec)
        return self._kv

    def hybridize(self, active: bool = True, **kwargs) -> None:
        """As ``HybridBlock.hybridize``, on one process only: a RuntimeError explains
        what to do on more workers."""
        if active and self.kv.num_workers > 1:
            raise RuntimeError(_HYBRIDIZE_HELP.format(n=self.kv.num_workers))
        if active and len(self._devices()) > 1:
            raise RuntimeError(_HYBRIDIZE_DEVICES_HELP.format(n=len(self._devices())))
        super().hybridize(active, **kwargs)

    def _devices(self) -> list:
        """The devices the layer's parameters live on ([] before initialisation)."""
        try:
            return self.gamma.list_ctx()
        except RuntimeError:
            return []

    def hybrid_forward(self, F, x, gamma, beta, running_mean, running_var):
        # Symbols come from a hybridized parent (refused on several workers by
        # hybridize()) or from shape inference for deferred initialisation.
        if (F is not mx.nd or self._kwargs["use_global_stats"]
                or not autograd.is_training()
                or (self.kv.num_workers == 1 and len(self._devices()) < 2)):
            return super().hybrid_forward(F, x, gamma, beta, running_mean, running_var)
        kwargs = self._kwargs
        axis = kwargs["axis"] % x.ndim
        if x.size == 0:
            # MXNet 1.9 runs no operator on a zero-size batch (shape inference fails):
            # say what to do rather than fail inside BatchNorm, and never divide 0 by 0
            raise ValueError(
                f"SyncBatchNorm got an empty batch {x.shape} on rank {self.kv.rank}; every "
                "rank needs at least one sample in every training step (the others wait "
                "for its statistics). Shard with dist_gluon.ShardSampler, which pads the "
                "shares to equal length, or skip the step on every rank")
        dtype = x.dtype
        if dtype != gamma.dtype:
            x = x.astype(gamma.dtype)
        if _join.current() is not None:
            _join.syncbn_forward(self, self._number(), autograd.is_recording())
        channel = self._channel(x, axis)
        # y = (x - mean) * scale + shift with scale = gamma / sqrt(var + eps) and shift =
        # beta from the global statistics, by MXNet's BatchNorm operator (fast, and its
        # backward gives the per-channel sums over x). Only the function from x, gamma
        # and beta to scale and shift is differentiated by hand, with MXNet operators on
        # x's device; autograd chains it.
        graphs = _layer_graphs(channel.channels, x.dtype, running_mean.dtype, kwargs["eps"],
                               kwargs["momentum"], kwargs["fix_gamma"], channel.gather)
        gb = mx.nd.concat(gamma, beta, dim=0)
        recording, count = autograd.is_recording(), x.size // channel.channels
        compiled = _compiled_forward(channel, graphs, axis, x, gb, count,
                                     (running_mean, running_var), recording)
        if compiled is None:
            affine = _GlobalAffine(axis, channel, graphs, count, (running_mean, running_var),
                                   recording)
            scale, shift = affine(x, gb)
            mean = affine.mean
        else:
            scale, shift, mean = compiled
        out = mx.nd.BatchNorm(x, scale, shift, mean, channel.unit_var, axis=axis,
                              eps=_UNIT_EPS, fix_gamma=False, use_global_stats=True)
        return out if out.dtype == dtype else out.astype(dtype)

    def _number(self) -> int:
        """This layer's number (its keys are ``syncbn.<number>.*``), given at its first
        training forward."""
        if self._name is None:
            self._name = f"syncbn.{next(_layer_numbers)}"
        return int(self._name.split(".")[1])

    def _shadow_forward(self, recording: bool) -> None:
        """dg.Join: a training forward (and, if ``recording``, its backward) of this
        layer on a rank that has no batch: its collectives with a sample count of 0 and
        zero gradients, and the running statistics updated from the global ones as on
        the ranks that have samples."""
        if len(self._comms) != 1 or next(iter(self._comms.values())).meetings is not None:
            raise _join.JoinError(
                f"SyncBatchNorm {self.name!r} on several devices of a worker cannot be "
                "shadowed by a rank that left a dg.Join block's loop")
        channel = next(iter(self._comms.values()))
        kwargs = self._kwargs
        running_mean, running_var = self.running_mean.data(), self.running_var.data()
        graphs = _layer_graphs(channel.channels, channel.ones.dtype, running_mean.dtype,
                               kwargs["eps"], kwargs["momentum"], kwargs["fix_gamma"],
                               channel.gather)
        channel.sums[:] = 0         # no samples: adds nothing, even to the count
        sums = channel.sum_forward()
        if recording:
            packed = mx.nd.concat(channel.zeros, channel.zeros, self.gamma.data(),
                                  self.beta.data(), dim=0)
            outputs = graphs["affine"](sums=sums, packed=packed, count=channel.count(0),
                                       running_mean=running_mean, running_var=running_var)
            outputs[5].copyto(running_mean)
            outputs[6].copyto(running_var)
            micro = channel.recorded_forward()
            channel.grads[micro][:] = 0
            channel.sum_backward(micro)

    def _channel(self, x: mx.nd.NDArray, axis: int) -> _Channel:
        """This layer's communication on ``x``'s device, made at the layer's first
        training forward in each round of the job (the number, its keys' name, at the
        first of all: a kept process and a new one number their layers alike)."""
        if self._round != worker.context().restart:
            # a process kept through a re-formation (dist_gluon.elastic.run): the new
            # round may give it another rank and world, and a new worker makes its
            # channels with a collective at its first training forward (below), which
            # this one must make too, or every later sum of the layer pairs with the
            # peer's one before (they hang, or sum the wrong steps' statistics)
            self._comms, self._meetings = {}, None
            self._round = worker.context().restart
        comm = self._comms.get(x.context)
        if comm is None:
            if self.kv.type == "dist_async":
                raise ValueError(
                    "SyncBatchNorm needs every worker's statistics at every step, and "
                    "dist_async workers do not step together; use nn.BatchNorm (each "
                    "worker normalises with its own batch), or dist_sync/p3/horovod")
            self._number()
            devices = self._devices()
            if x.context not in devices:
                raise ValueError(f"SyncBatchNorm {self.name!r} got an input on {x.context}, "
                                 f"but its parameters live on {devices}")
            comm = _Channel(self.kv, self._name, x.shape[axis], x.context, x.dtype,
                            devices, self._side(x, devices))
            if self.kv.num_workers > 1 and comm.side is None:
                self.kv._chained("SyncBatchNorm's sums, two per layer and step")
            if len(devices) > 1 and self._meetings is None:
                self._meetings = (_Meeting(self.kv, comm.forward_key, devices, comm.sums),
                                  {})
            comm.meetings = self._meetings
            self._comms[x.context] = comm
        if comm.meetings is not None:
            comm.meetings[0].count_forward(x.context, self.name)
        return comm

    def _side(self, x: mx.nd.NDArray, devices: list) -> sidechannel.SideChannel | None:
        """The side channel this layer's sums take (set up by the first layer that takes
        it: a collective), or None for the backend's: one device per worker, on the CPU,
        float32 or float64, where :func:`sidechannel.enabled` (the same on every rank)."""
        if (len(devices) > 1 or not sidechannel.enabled(self.kv)
                or not sidechannel.serves(x)):
            return None
        return sidechannel.channel(self.kv)


_HYBRIDIZE_DEVICES_HELP = (
    "dist_gluon.SyncBatchNorm cannot run in a hybridized graph on {n} devices: the "
    "devices meet in every forward and backward pass to sum their statistics, which a "
    "cached graph cannot do. Do not call hybridize() on a network that contains "
    "SyncBatchNorm (hybridize only blocks without it), or use gluon.nn.BatchNorm.")


# sqrt(1 + _UNIT_EPS) == 1 in float32: a BatchNorm operator given variance 1 only
# shifts and scales
_UNIT_EPS = 1e-12


class _Channel:
    """A layer's two keys and the arrays they carry, the same arrays in every step: the
    engine orders each step's use after the previous one's, so no call has to wait for
    the previous step's collective (a backward collective may be issued while the
    script's thread is already a step ahead, and must not wait for it). Both keys are
    created here, on the script's thread in the order of the forward pass: ps-lite
    creates a key with a barrier of all workers, which must not run in MXNet's backward
    threads.

    The forward collective sums, per channel, ``[n * mean, n * (var + mean^2), n]`` in
    float64 (each worker's own batch's mean and biased variance, n its samples per
    channel): in float64 the global ``E[x^2] - mean^2`` does not cancel (in float32 it
    would, where a channel's mean is large next to its spread), and the sum is the same
    on every rank. Where the backend has no float64 sum of its own (ps-lite's servers
    sum in float32, and its exact float64 path costs a dozen operators) and the data is
    not float64, the collective is an all-gather instead: each worker writes ``[mean,
    var, n]`` (float32, exact) into its own row of a zero ``(workers, 2 C + 1)`` array,
    the servers' sum leaves every row exact (``x + 0``), and every worker forms the
    float64 sums from the rows on its device. The backward collective sums the
    gradients of the global mean and variance in the data's dtype (nothing cancels
    there); each micro-batch of a step (the n-th recorded forward since the trainer's
    last step) has its own key and array, made at its first forward
    (:meth:`recorded_forward`)."""

    def __init__(self, kv: Backend, name: str, channels: int, ctx, dtype, devices: list,
                 side: sidechannel.SideChannel | None = None):
        self.kv = kv
        self.channels = channels
        self.forward_key, self.backward_key = f"{name}.forward", f"{name}.backward"
        # the sums go over SyncBatchNorm's side channel where it has one, not the backend
        self.side = side
        if side is not None:
            side.name_key(self.forward_key)
        # the layer's (forward _Meeting, {micro-batch: backward _Meeting}) of the
        # worker's devices, where it has several
        self.meetings: tuple | None = None
        self._devices = devices
        # Used by the forward pass, on the script's thread: the sums, and inputs of the
        # BatchNorm operators (constants). Gathered, every device of every worker has a
        # row of its own.
        self.gather = dtype != np.float64 and not kv._sums_float64
        rows = kv.num_workers * len(devices)
        shape = (rows, 2 * channels + 1) if self.gather else (2 * channels + 1,)
        self.sums = mx.nd.zeros(shape, ctx=ctx, dtype="float32" if self.gather else "float64")
        row = kv.rank * len(devices) + devices.index(ctx)
        self.own_row = mx.nd.one_hot(mx.nd.full((1,), row, ctx=ctx), rows)
        self.one = mx.nd.ones((1,), ctx=ctx, dtype="float64")
        self.ones = mx.nd.ones((channels,), ctx=ctx, dtype=dtype)
        self.zeros = mx.nd.zeros((channels,), ctx=ctx, dtype=dtype)
        self.unit_var = mx.nd.ones((channels,), ctx=ctx, dtype=dtype)
        self.scratch = [mx.nd.zeros((channels,), ctx=ctx, dtype=dtype) for _ in range(2)]
        self._counts: dict[int, mx.nd.NDArray] = {}
        # Used by the backward functions only. MXNet calls them in its own threads once
        # their inputs are ready, when the script's thread may have queued the next
        # step's forward already: an operator they queue on an array of the forward pass
        # would wait for that next forward, which waits for this backward. One array
        # per micro-batch of a step: two backward functions may run at once.
        self.grads: dict[int, mx.nd.NDArray] = {}
        self.backward_unit_var = mx.nd.ones((channels,), ctx=ctx, dtype=dtype)
        self._step, self._forwards = None, 0
        # the compiled forward's plan of these arrays and the layer's graphs
        self._plan, self._plan_graphs = None, None

    def plan(self, graphs: dict[str, _Graph], axis: int) -> int:
        """The compiled forward's plan (``_sidesum.cc``'s Plan) of this channel's arrays
        and ``graphs``, made at the first call."""
        if self._plan_graphs is not graphs:
            lib = self.side._lib
            self.close_plan()
            fixed = [a.handle for a in (self.ones, self.zeros, *self.scratch, self.own_row,
                                        self.sums)]
            names = ("local", "sums", "affine", "mine", "back")
            orders = [[_FORWARD_SLOTS[n] for n in graphs[g]._names] for g in names[:3]]
            orders += [[_SLOTS[n] for n in graphs[g]._names] for g in names[3:]]
            flat = [slot for order in orders for slot in order]
            ctx = self.ones.context
            self._plan = lib.dg_syncbn_plan(
                self.side._handle, sidechannel.key_id(self.forward_key),
                sidechannel._DTYPES[np.dtype(self.sums.dtype)], self.sums.size,
                sidechannel._DTYPES[np.dtype(self.ones.dtype)], 2 * self.channels,
                (ctypes.c_void_p * len(fixed))(*fixed), self.backward_unit_var.handle,
                (ctypes.c_void_p * len(names))(*[graphs[g]._op.handle for g in names]),
                (ctypes.c_int * len(flat))(*flat),
                (ctypes.c_int * len(orders))(*[len(o) for o in orders]),
                ctx.device_typeid, ctx.device_id, axis)
            self._plan_graphs = graphs
        return self._plan

    def close_plan(self) -> None:
        if self._plan is not None:
            self.side._lib.dg_syncbn_plan_free(ctypes.c_void_p(self._plan))
            self._plan, self._plan_graphs = None, None

    def __del__(self):
        try:
            self.close_plan()
        except Exception:   # noqa: BLE001 - at exit the library may be gone
            pass

    def recorded_forward(self) -> int:
        """On the script's thread, at a recorded training forward: its micro-batch, the
        number of recorded forwards of the layer on this device since the trainer's last
        step (the same on every rank and device), whose backward key and array are made
        here at its first use (ps-lite creates a key with a barrier of all workers,
        which must not run in MXNet's backward threads)."""
        if self._step != _steps_ended:
            self._step, self._forwards = _steps_ended, 0
        micro = self._forwards % MICRO_BATCH_KEYS
        self._forwards += 1
        if micro not in self.grads:
            grads = self.grads[micro] = mx.nd.zeros((2 * self.channels,),
                                                    ctx=self.ones.context,
                                                    dtype=self.ones.dtype)
            if self.side is not None:
                self.side.name_key(self._backward_key(micro))
            elif self.meetings is None:
                _pushpull(self.kv, self._backward_key(micro), grads)
            elif micro not in self.meetings[1]:
                self.meetings[1][micro] = _Meeting(self.kv, self._backward_key(micro),
                                                   self._devices, grads)
        return micro

    def _backward_key(self, micro: int) -> str:
        """Micro-batch ``micro``'s backward key: the first keeps the layer's own."""
        return self.backward_key if micro == 0 else f"{self.backward_key}.{micro}"

    def sum_forward(self) -> mx.nd.NDArray:
        """The forward collective on :attr:`sums`: the sum over every device of every
        worker."""
        if self.side is not None:
            self.side.sum(self.forward_key, self.sums)
        elif self.meetings is None:
            _pushpull(self.kv, self.forward_key, self.sums)
        else:
            return self.meetings[0].join(self.sums)
        return self.sums

    def sum_backward(self, micro: int) -> mx.nd.NDArray:
        """The backward collective of micro-batch ``micro`` on its :attr:`grads` (from
        MXNet's backward threads)."""
        grads = self.grads[micro]
        if self.side is not None:
            self.side.sum(self._backward_key(micro), grads)
        elif self.meetings is None:
            _pushpull(self.kv, self._backward_key(micro), grads)
        else:
            return self.meetings[1][micro].join(grads)
        return grads

    def count(self, n: int) -> mx.nd.NDArray:
        """``[n]`` (float64) on the layer's device, made once per batch shape by an
        operator (not uploaded from the host)."""
        array = self._counts.get(n)
        if array is None:
            array = self._counts[n] = mx.nd.full((1,), n, ctx=self.one.context,
                                                 dtype="float64")
        return array


def _pushpull(kv: Backend, key: str, value: mx.nd.NDArray) -> None:
    # from autograd's threads too: the backend's submission is thread-safe
    kv.pushpull(key, value, priority=_PRIORITY)


class _Graph:
    """A small computation of per-channel values as one cached MXNet graph: a layer's
    arithmetic between its collectives is a dozen operators on C numbers, which cost
    far more to invoke one by one from Python than to run."""

    def __init__(self, outputs):
        symbol = outputs if isinstance(outputs, mx.sym.Symbol) else mx.sym.Group(outputs)
        self._names = symbol.list_inputs()
        self._op = mx.nd.CachedOp(symbol)

    def __call__(self, out=None, **arrays):
        return self._op(*[arrays[name] for name in self._names], out=out)


_graphs: dict[tuple, dict[str, _Graph]] = {}


def _layer_graphs(c: int, dtype, running_dtype, eps: float, momentum: float,
                  fix_gamma: bool, gather: bool) -> dict[str, _Graph]:
    """The cached graphs of a layer with ``c`` channels (shared by equal layers)."""
    key = (c, np.dtype(dtype).name, np.dtype(running_dtype).name, eps, momentum, fix_gamma,
           gather)
    if not gather and _amp_initialized():
        raise RuntimeError(_AMP_HELP)
    if key not in _graphs:
        _graphs[key] = _build_graphs(c, np.dtype(dtype).name, np.dtype(running_dtype).name,
                                     eps, momentum, fix_gamma, gather)
    return _graphs[key]


def _build_graphs(c, dtype, running_dtype, eps, momentum, fix_gamma,
                  gather) -> dict[str, _Graph]:
    sym, f64 = mx.sym, "float64"

    def part(array, begin, end):
        return sym.slice_axis(array, axis=0, begin=begin, end=end)

    # _GlobalAffine, forward: [mean, var, gamma, beta] of this worker from the BatchNorm
    # operator's mean and 1 / sqrt(var + eps)
    mean, invstd = sym.var("mean"), sym.var("invstd")
    local = sym.concat(mean, sym.relu(invstd ** -2 - _GlobalAffine._EPS), sym.var("gb"), dim=0)

    # ... its sums [n mean, n (var + mean^2), n] (float64)
    packed, count = sym.var("packed"), sym.var("count")
    mean, var = part(packed, 0, c).astype(f64), part(packed, c, 2 * c).astype(f64)
    sums = sym.broadcast_mul(sym.concat(mean, sym.square(mean) + var,
                                        sym.ones((1,), dtype=f64), dim=0), count)
    if gather:
        # this worker's exact [mean, var, n] in its own row
        own = sym.concat(mean, var, count, dim=0).astype("float32").reshape((1, -1))
        sums = sym.broadcast_mul(sym.var("own_row").reshape((-1, 1)), own)

    # ... and from every worker's sums, the global statistics, the affine transform and
    # the running statistics' next values (momentum and 1 - momentum in float32, as
    # MXNet's BatchNorm computes them: (1 - 0.9f) is not 0.1f)
    total_sums = sym.var("sums")
    if gather:
        rows = total_sums.astype(f64)
        mean, var = sym.slice_axis(rows, axis=1, begin=0, end=c), \
            sym.slice_axis(rows, axis=1, begin=c, end=2 * c)
        count_rows = sym.slice_axis(rows, axis=1, begin=2 * c, end=2 * c + 1)
        total_sums = sym.sum(sym.broadcast_mul(
            sym.concat(mean, sym.square(mean) + var, sym.ones_like(count_rows), dim=1),
            count_rows), axis=0)
    total = part(total_sums, 2 * c, 2 * c + 1)
    moments = sym.broadcast_div(part(total_sums, 0, 2 * c), total)
    mean = part(moments, 0, c)
    var = sym.relu(part(moments, c, 2 * c) - sym.square(mean))
    invstd = sym.rsqrt(var + eps).astype(dtype)
    scale = invstd if fix_gamma else part(packed, 2 * c, 3 * c) * invstd
    keep = np.float32(momentum)
    running = [sym.var(name) * float(keep) + stat.astype(running_dtype)
               * float(np.float32(1) - keep)
               for name, stat in (("running_mean", mean), ("running_var", var))]
    share = (1.0 / total).astype(dtype)
    affine = [scale, part(packed, 3 * c, 4 * c), mean.astype(dtype), invstd, share,
              *running]

    # _GlobalAffine, backward: this worker's gradients of the global mean and variance
    dscale, dshift, scale = sym.var("dscale"), sym.var("dshift"), sym.var("scale")
    invstd = sym.var("invstd")
    mine = sym.concat(-scale * dshift, dscale * scale * sym.square(invstd) * -0.5, dim=0)

    # ... and from every worker's, the gradients of this worker's inputs: of gamma and
    # beta, and of x through its mean and variance, ``dx = d own_mean / n_own + 2 d
    # own_var (x - own_mean) / n_own`` with ``d own_mean = (dmean + 2 dvar (own_mean -
    # mean)) n_own / n`` and ``d own_var = dvar n_own / n``: the scale and the shift that
    # the BatchNorm operator applies to ``x - own_mean``
    grads, share = sym.var("grads"), sym.var("share")
    own_mean, mean = sym.var("own_mean"), sym.var("mean")
    dmean, dvar = part(grads, 0, c), part(grads, c, 2 * c)
    dgamma = sym.zeros_like(dscale) if fix_gamma else dscale * invstd
    back = [sym.broadcast_mul(2 * dvar, share),
            sym.broadcast_mul(dmean + 2 * dvar * (own_mean - mean), share),
            sym.concat(dgamma, dshift, dim=0)]
    return {name: _Graph(graph) for name, graph in
            (("local", local), ("sums", sums), ("affine", affine), ("mine", mine),
             ("back", back))}


def _on(array: mx.nd.NDArray, ctx) -> mx.nd.NDArray:
    """``array`` on ``ctx``. MXNet hands an autograd Function's backward its CPU arrays
    labelled cpu(0) whatever their device (it runs them as custom operators), which
    matters only where a worker drives several CPU contexts."""
    return array if array.context == ctx else array.as_in_context(ctx)


class _Function(autograd.Function):
    """``autograd.Function`` that gives every input that needs a gradient its gradient.

    MXNet 1.9's ``Function`` stops writing input gradients at the first input that needs
    none (``return True`` in its backward entry), so an input after one that autograd does
    not follow (a layer's first input taken straight from the data, frozen gamma and beta)
    would silently get no gradient, and it never adds to a gradient whose request is
    ``add``. This is its ``__call__`` (MXNet 1.9.1) with that loop fixed."""

    def __call__(self, *inputs):
        assert not self._used, "each Function instance can only be called once"
        self._used = True
        previous = autograd.set_recording(False)
        outputs = self.forward(*inputs)
        autograd.set_recording(previous)
        if not previous:
            return outputs
        results = (outputs,) if isinstance(outputs, mx.nd.NDArray) else outputs
        key = autograd.Function._registry.inc()

        def backward_entry(num_ograds, num_igrads, ptrs, reqs, is_train, _):
            try:
                output_grads = [mx.nd.NDArray(ctypes.cast(i, mx.base.NDArrayHandle),
                                              writable=False) for i in ptrs[:num_ograds]]
                input_grads = [mx.nd.NDArray(ctypes.cast(i, mx.base.NDArrayHandle),
                                             writable=True)
                               for i in ptrs[num_ograds:num_ograds + num_igrads]]
                requests = [reqs[i] for i in range(num_igrads)]
                returned = self.backward(*output_grads)
                if isinstance(returned, mx.nd.NDArray):
                    returned = (returned,)
                for grad, value, req in zip(input_grads, returned, requests):
                    if req in (1, 2):           # write, inplace
                        grad[:] = value
                    elif req == 3:              # add
                        grad[:] += value
            except Exception:   # noqa: BLE001 - MXNet's C callback takes no exception
                traceback.print_exc()
                return False
            return True

        def delete_entry(_):
            autograd.Function._registry.ref_holder.pop(key, None)
            return True

        callbacks = [ctypes.cast(autograd.Function._bwd_functype(backward_entry),
                                 ctypes.CFUNCTYPE(ctypes.c_int)),
                     ctypes.cast(autograd.Function._del_functype(delete_entry),
                                 ctypes.CFUNCTYPE(ctypes.c_int))]
        context = mx.base.MXCallbackList(
            ctypes.c_int(len(callbacks)),
            ctypes.cast(mx.base.c_array(ctypes.CFUNCTYPE(ctypes.c_int), callbacks),
                        ctypes.POINTER(ctypes.CFUNCTYPE(ctypes.c_int))),
            ctypes.cast(mx.base.c_array(ctypes.c_void_p, [None] * len(callbacks)),
                        ctypes.POINTER(ctypes.c_void_p)))
        autograd.Function._registry.ref_holder[key] = context
        mx.base.check_call(mx.base._LIB.MXCustomFunctionRecord(
            ctypes.c_int(len(inputs)), mx.base.c_handle_array(inputs),
            ctypes.c_int(len(results)), mx.base.c_handle_array(results),
            ctypes.byref(context)))
        return outputs


class _GlobalAffine(_Function):
    """From ``x`` and ``[gamma, beta]`` to the ``scale`` and ``shift`` of ``y = (x - mean)
    * scale + shift``: this worker's per-channel mean and biased variance (MXNet's
    BatchNorm operator in training mode; its own reductions are 10-50 times slower on
    CPU), their sums over every worker (the forward collective), hence the global mean
    (``self.mean``, which the BatchNorm operator subtracts) and biased variance, ``scale
    = gamma / sqrt(var + eps)`` and ``shift = beta``; the running statistics move
    towards them. The backward pass sums the gradients of the global mean and variance
    over the workers (the backward collective: each worker's loss depends on every
    worker's statistics) and turns them into x's gradient, again by the BatchNorm
    operator; those of gamma and beta stay this worker's, which the trainer sums.
    Everything runs on the engine, on the layer's device (cached graphs). One function
    per layer, not one per collective: each costs a hop to MXNet's custom-operator
    threads and back in the backward pass, on its critical path."""

    # the operator returns 1 / sqrt(var + eps); a tiny eps keeps var exact
    _EPS = 1e-10

    def __init__(self, axis: int, channel: _Channel, graphs: dict[str, _Graph], count: int,
                 running, update: bool):
        super().__init__()
        self._axis, self._channel, self._graphs = axis, channel, graphs
        self._running, self._update = running, update
        self._count = channel.count(count)
        # the micro-batch whose backward collective this forward's backward makes
        self._micro = channel.recorded_forward() if update else None
        self.mean = None

    def forward(self, x, gb):
        ch, graphs = self._channel, self._graphs
        _, own_mean, own_invstd = mx.nd.BatchNorm(
            x, ch.ones, ch.zeros, *ch.scratch, axis=self._axis, eps=self._EPS,
            fix_gamma=False, output_mean_var=True)
        packed = graphs["local"](mean=own_mean, invstd=own_invstd, gb=gb)
        extra = {"own_row": ch.own_row} if ch.gather else {}
        graphs["sums"](packed=packed, count=self._count, out=ch.sums, **extra)
        sums = ch.sum_forward()
        running_mean, running_var = self._running
        scale, shift, mean, invstd, share, new_mean, new_var = graphs["affine"](
            sums=sums, packed=packed, count=self._count, running_mean=running_mean,
            running_var=running_var)
        if self._update:
            new_mean.copyto(running_mean)
            new_var.copyto(running_var)
        self.mean = mean
        self._saved = (x, own_mean, mean, invstd, scale, share)
        return scale, shift

    def backward(self, dscale, dshift):
        """shift is ``beta + scale * (mean - mean)`` to autograd: the output depends on
        the mean through it, ``dmean = -scale * dshift``; and on the variance through
        scale, ``dvar = -dscale * scale * invstd^2 / 2``. Summed over the workers, they
        flow to this worker's mean and variance, and from them to x (see the graph
        ``back``)."""
        ch, graphs = self._channel, self._graphs
        x, own_mean, mean, invstd, scale, share = self._saved
        dscale, dshift = _on(dscale, scale.context), _on(dshift, scale.context)
        graphs["mine"](dscale=dscale, dshift=dshift, scale=scale, invstd=invstd,
                       out=ch.grads[self._micro])
        grads = ch.sum_backward(self._micro)
        dx_scale, dx_shift, dgb = graphs["back"](
            grads=grads, own_mean=own_mean, mean=mean, share=share, dscale=dscale,
            dshift=dshift, invstd=invstd)
        dx = mx.nd.BatchNorm(x, dx_scale, dx_shift, own_mean, ch.backward_unit_var,
                             axis=self._axis, eps=_UNIT_EPS, fix_gamma=False,
                             use_global_stats=True)
        return dx, dgb


# The arrays the compiled backward hands the graphs "mine" and "back", by their names in
# the graphs (the order of _sidesum.cc's Slot)
_SLOTS = {name: slot for slot, name in enumerate(
    ("dscale", "dshift", "scale", "invstd", "grads", "own_mean", "mean", "share"))}
# ... and the compiled forward the graphs "local", "sums" and "affine" (ForwardSlot)
_FORWARD_SLOTS = {name: slot for slot, name in enumerate(
    ("x", "ones", "zeros", "scratch0", "scratch1", "gb", "mean", "invstd", "packed", "count",
     "own_row", "sums", "running_mean", "running_var"))}


def _compiled_forward(ch: _Channel, graphs: dict[str, _Graph], axis: int, x, gb,
                      count: int, running, recording: bool):
    """The layer's forward pass as :class:`_GlobalAffine` computes it, queued by
    ``_sidesum.cc`` in one call (with the compiled backward, where ``recording``): the
    same operators on the same arrays, without a dozen calls from Python at every layer.
    Returns (scale, shift, global mean), or None where the layer takes the Python path:
    no side channel, a device other than cpu(0), ``DG_SYNCBN_NATIVE=0``, or an input
    with a gradient of its own attached (rare: x is a layer's output; the tests prove
    the compiled callback on layers' outputs, whose gradients autograd asks it to
    write)."""
    if (ch.side is None or x.context != mx.cpu(0) or not _compiled_ready(ch.side)
            or (recording and x.grad is not None)):
        return None
    lib = ch.side._lib
    plan = ch.plan(graphs, axis)
    grads, key = None, 0
    if recording:
        micro = ch.recorded_forward()
        grads, key = ch.grads[micro].handle, sidechannel.key_id(ch._backward_key(micro))
    out = (ctypes.c_void_p * 4)()
    previous = autograd.set_recording(False)
    try:
        failed = lib.dg_syncbn_forward(plan, x.handle, gb.handle, ch.count(count).handle,
                                       running[0].handle, running[1].handle, int(recording),
                                       grads, key, out)
    finally:
        autograd.set_recording(previous)
    if failed:
        raise mx.base.MXNetError(lib.dg_syncbn_error().decode(errors="replace"))
    scale, shift, mean = (mx.nd.NDArray(mx.base.NDArrayHandle(h)) for h in out[:3])
    if recording and lib.dg_syncbn_record(out[3], x.handle, gb.handle, scale.handle,
                                          shift.handle):
        raise mx.base.MXNetError(mx.base.py_str(mx.base._LIB.MXGetLastError()))
    return scale, shift, mean


_compiled: bool | None = None


def _compiled_backwards() -> int:
    """How many layer backwards the compiled callback has run in this process (0 where
    it is off)."""
    return sidechannel._library().dg_syncbn_calls() if _compiled else 0


def _compiled_ready(side: sidechannel.SideChannel) -> bool:
    """Whether the compiled layer (forward and backward, ``_sidesum.cc``) is on, handing
    the library MXNet's C API at the first call."""
    global _compiled
    if _compiled is None:
        _compiled = False
        lib = side._lib
        if os.environ.get("DG_SYNCBN_NATIVE", "1") != "0" and hasattr(lib, "dg_syncbn_api"):
            api = mx.base._LIB
            functions = [api.MXImperativeInvokeEx, api.MXInvokeCachedOpEx,
                         api.MXEnginePushAsyncND, api.MXShallowCopyNDArray, api.MXNDArrayFree,
                         api.MXNDArrayGetData, api.MXGetLastError, api.MXCustomFunctionRecord]
            creators = []
            for name in ("BatchNorm", "_copyto", "elemwise_add"):
                handle = ctypes.c_void_p()
                mx.base.check_call(api.NNGetOpHandle(mx.base.c_str(name), ctypes.byref(handle)))
                creators.append(handle.value)
            lib.dg_syncbn_api(
                (ctypes.c_void_p * len(functions))(
                    *[ctypes.cast(f, ctypes.c_void_p).value for f in functions]),
                (ctypes.c_void_p * len(creators))(*creators))
            lib.dg_syncbn_record.argtypes = [ctypes.c_void_p] * 5
            lib.dg_syncbn_plan.restype = ctypes.c_void_p
            lib.dg_syncbn_plan.argtypes = [
                ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int, ctypes.c_int64, ctypes.c_int,
                ctypes.c_int64, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p,
                ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int),
                ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int, ctypes.c_int]
            lib.dg_syncbn_plan_free.argtypes = [ctypes.c_void_p]
            lib.dg_syncbn_forward.argtypes = [ctypes.c_void_p] * 6 + [
                ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64, ctypes.POINTER(ctypes.c_void_p)]
            lib.dg_syncbn_error.restype = ctypes.c_char_p
            lib.dg_syncbn_calls.restype = ctypes.c_int64
            _compiled = True
    return _compiled


# How long a device waits in a layer's collective for the worker's other devices before
# it raises (they compute the same layer on their own shares, seconds apart at most).
MEETING_TIMEOUT = 300.0
# MXNET_CPU_TEMP_COPY needed where CPU contexts stand in for a worker's several devices:
# more than the operators of one forward pass that take temporary space (the copies are
# dealt round robin; ResNet-18 hangs with 64)
CPU_TEMP_COPIES = 1024


class _Meeting:
    """One collective of a layer that the worker's several devices join: the devices'
    arrays are summed on the first device, that sum is summed over the workers (one
    collective per worker), and every device gets the result.

    A script runs the network on its devices one after the other (``[net(x) for x in
    split_and_load(...)]``), so device 0's next layer is queued before device 1 has
    produced its statistics. The meeting is therefore a custom operator (``join``): MXNet
    runs it in its own custom-operator threads once its input is computed, where it may
    wait for the other devices' turns without blocking the engine's workers or the
    script. The key is created on the script's thread, with an array of the shape it
    carries (ps-lite creates keys with a barrier)."""

    _registry: dict[str, _Meeting] = {}

    def __init__(self, kv: Backend, key: str, devices: list, template: mx.nd.NDArray):
        copies = int(os.environ.get("MXNET_CPU_TEMP_COPY", "4"))
        if any(ctx.device_type == "cpu" for ctx in devices) and copies < CPU_TEMP_COPIES:
            raise RuntimeError(
                f"SyncBatchNorm on several CPU contexts of one process ({devices}) needs "
                f"MXNET_CPU_TEMP_COPY={CPU_TEMP_COPIES} or more in the environment before "
                f"MXNet starts (it is {copies}): MXNet shares its CPU temporary space "
                "among cpu(0), cpu(1)..., and the layers device 0 has queued would hold "
                "it while device 1 still has to compute the statistics they wait for. "
                "GPUs have their own (this is for CPU contexts standing in for GPUs, as "
                "in tests); to train on CPUs, run one process per CPU context instead")
        self.kv, self.key = kv, key
        self._index = {ctx: i for i, ctx in enumerate(devices)}
        self._cond = threading.Condition()
        self._arrived: dict[int, mx.nd.NDArray] = {}
        self._generation = 0
        self._results: dict[int, mx.nd.NDArray] = {}
        self._forwards = dict.fromkeys(devices, 0)
        _Meeting._registry[key] = self
        _pushpull(kv, key, template.copy())

    def count_forward(self, ctx, layer: str) -> None:
        """On the script's thread: refuse a device's second training forward before every
        device has had its first (the devices would wait for each other forever)."""
        self._forwards[ctx] += 1
        behind = [c for c, n in self._forwards.items() if n < self._forwards[ctx] - 1]
        if behind:
            raise RuntimeError(
                f"SyncBatchNorm {layer!r}: {ctx} ran {self._forwards[ctx]} training forwards "
                f"while {behind[0]} ran {self._forwards[behind[0]]}; with its parameters on "
                f"{len(self._forwards)} devices ({list(self._forwards)}), every training "
                "forward must run on every device, in the same order on every worker "
                "(split the batch with gluon.utils.split_and_load)")

    def join(self, value: mx.nd.NDArray) -> mx.nd.NDArray:
        """Queue this device's part; returns the array that will hold the total."""
        # the device by number: a custom operator's CPU arrays all say cpu(0)
        return mx.nd.Custom(value, op_type="dg_syncbn_meeting", meeting=self.key,
                            device=str(self._index[value.context]))

    def meet(self, device: int, value: mx.nd.NDArray) -> mx.nd.NDArray:
        """In a custom-operator thread: add ``value`` of device number ``device``; the
        last device sums and starts the collective, the others wait for it."""
        with self._cond:
            generation = self._generation
            self._arrived[device] = value
            if len(self._arrived) == len(self._index):
                total = self._arrived[0].copy()
                for i in range(1, len(self._index)):
                    total += self._arrived[i].as_in_context(total.context)
                _pushpull(self.kv, self.key, total)
                self._results[generation] = total
                self._results.pop(generation - 2, None)
                self._arrived = {}
                self._generation += 1
                self._cond.notify_all()
                return total
            waited = self._cond.wait_for(lambda: self._generation != generation,
                                         timeout=MEETING_TIMEOUT)
            if not waited:
                missing = [str(c) for c, i in self._index.items() if i not in self._arrived]
                raise RuntimeError(
                    f"SyncBatchNorm collective {self.key!r} waited {MEETING_TIMEOUT:.0f} s "
                    f"for {', '.join(missing)}: every device of a worker must run every "
                    "training forward and backward of the network")
            return self._results[generation]


class _MeetingOp(mx.operator.CustomOp):
    def __init__(self, meeting: _Meeting, device: int):
        super().__init__()
        self._meeting, self._device = meeting, device

    def forward(self, is_train, req, in_data, out_data, aux):
        total = self._meeting.meet(self._device, in_data[0])
        self.assign(out_data[0], req[0], total.as_in_context(out_data[0].context))

    def backward(self, req, out_grad, in_data, out_data, in_grad, aux):
        # never recorded: it runs inside SyncBatchNorm's autograd Functions
        raise RuntimeError("SyncBatchNorm's device meeting has no gradient")


@mx.operator.register("dg_syncbn_meeting")
class _MeetingProp(mx.operator.CustomOpProp):
    def __init__(self, meeting, device):
        super().__init__(need_top_grad=False)
        self._meeting, self._device = meeting, int(device)

    def list_arguments(self):
        return ["data"]

    def list_outputs(self):
        return ["output"]

    def infer_shape(self, in_shape):
        return in_shape, [in_shape[0]], []

    def infer_type(self, in_type):
        return in_type, [in_type[0]], []

    def create_operator(self, ctx, shapes, dtypes):
        return _MeetingOp(_Meeting._registry[self._meeting], self._device)


def convert_sync_batchnorm(net, kv=None):
    """Turn every ``gluon.nn.BatchNorm`` layer of ``net`` into a :class:`SyncBatchNorm`,
    in place, keeping its parameters (the same Parameter objects, with their values,
    names, initialisation state and gradients) and its arguments.

    Like ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``, for models that build their
    own BatchNorm layers. Only layers of exactly ``nn.BatchNorm`` are converted: other
    normalisation layers (``BatchNormReLU``, subclasses with their own behaviour,
    ``contrib.nn.SyncBatchNorm``) are left alone. Convert before ``hybridize()``: on more
    than one worker, a network that is already hybridized raises a RuntimeError.

    Parameters
    ----------
    net : Block
        The network (or a single BatchNorm layer).
    kv : backend, backend name or None
        As in :class:`SyncBatchNorm`.

    Returns
    -------
    Block
        ``net`` itself, converted.

    Examples
    --------
    >>> net = gluon.model_zoo.vision.resnet18_v1()
    >>> net.load_parameters('resnet18.params')
    >>> dg.convert_sync_batchnorm(net)
    """
    if not isinstance(net, mx.gluon.Block):
        raise TypeError(f"net must be a gluon Block, got {type(net).__name__}")
    blocks = list(_walk(net))
    layers = [b for b in blocks if type(b) is nn.BatchNorm]
    if not layers:
        return net
    workers = resolve(kv).num_workers
    hybridized = [b for b in blocks if getattr(b, "_active", False)]
    if workers > 1 and hybridized:
        raise RuntimeError(_HYBRIDIZE_HELP.format(n=workers)
                           + f" {hybridized[0].name!r} is hybridized: convert before "
                           "hybridize(), or call net.hybridize(False) first.")
    for layer in layers:
        # The layer itself changes class, so every reference to it (its parent's
        # attribute and child list, a list kept by the model, a trainer's parameters)
        # sees the converted layer; SyncBatchNorm only adds _attach's state.
        layer.__class__ = SyncBatchNorm
        layer._attach(kv)
    for block in blocks:
        if isinstance(block, mx.gluon.HybridBlock):
            block._clear_cached_op()
    return net


def _walk(block):
    yield block
    for child in block._children.values():
        yield from _walk(child)


__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]
