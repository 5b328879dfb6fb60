"""Local SGD and DiLoCo: workers step alone and meet every ``sync_every`` steps.

``DistributedTrainer(..., sync_every=H)`` (Local SGD; Lin et al., ICLR 2020, "Don't use
large mini-batches, use local SGD") and ``DistributedTrainer(..., sync_every=H,
outer_optimizer='nag', outer_optimizer_params={'learning_rate': 0.7, 'momentum': 0.9})``
(DiLoCo; Douillard et al., 2023) run in rounds of H steps:

1. At a round's first step every worker holds the same *global* parameters, kept here
   as the round's anchor (one copy of the trainable parameters, on the first device).
2. For H steps each worker steps its own optimizer on its own gradients, rescaled by
   its own batch size: no collective at all. With several devices a worker still sums
   its devices' gradients first (one process on all of its devices' samples).
3. At the H-th step each worker computes its pseudo-gradient ``anchor - weights`` and
   the workers average them (one sum per parameter, through the trainer's codec if it
   has one, with its own residuals).
4. Local SGD: ``anchor -= average``, which is the average of the workers' parameters.
   DiLoCo: the outer optimizer (any MXNet optimizer, ``rescale_grad`` 1) updates the
   anchor with the average as its gradient; ``outer_optimizer='sgd'`` with learning
   rate 1 and no momentum is Local SGD.
5. Every worker continues from the new anchor, on every device.

Each worker's inner optimizer state (momentum, Adam's moments) is kept across a
synchronisation, as in the DiLoCo paper: it is each worker's own from the first local
step on, and only the parameters are replaced. With plain SGD (momentum and weight
decay included, which are linear) ``sync_every=1`` is exactly today's per-step
averaging of the gradients when the workers' batch sizes are equal.

Post-local SGD: with ``local_sgd_warmup=K`` the first K steps synchronise the gradients
every step as without ``sync_every`` (inner optimizer states then stay identical on
every rank), and the rounds start after them.

Overlap (``sync_delay=D``, 1 <= D <= H): the sum of step 3 is started and the workers go
on with the next round's local steps from their own parameters meanwhile; D local steps
later each worker adds the outer step's correction, ``new anchor - (its parameters at
the synchronisation)``, to its current parameters (waiting there for the sum only if it
has not arrived). So the global update of a round reaches the workers D steps late, on
top of the local progress made meanwhile (the overlapped form of Streaming DiLoCo,
Douillard et al., 2025), and the workers never hold identical parameters between
rounds; :meth:`synchronise` with ``wait=True`` (``trainer.sync_weights()``) applies a
pending correction, then synchronises without delay, after which they do. D = 0 is
the algorithm of steps 1-5.

The parameters with ``grad_req='null'`` (BatchNorm's running statistics) are never
averaged: each worker keeps its own, as it does with per-step averaging.

All of it runs on MXNet's engine; a synchronisation queues the subtractions, the sums
and the outer update without waiting for them.
"""
from __future__ import annotations

import mxnet as mx
import numpy as np

from .averaging import _GradientAverager
from .broadcast import optimizer_state_arrays, set_update_counters, update_counters


def check_sync_every(sync_every, warmup, outer_optimizer, outer_optimizer_params,
                     delay=0) -> None:
    """Refuse, with a ValueError naming the argument, what a trainer cannot run."""
    if isinstance(sync_every, bool) or not isinstance(sync_every, (int, np.integer)) \
            or sync_every < 1:
        raise ValueError(f"sync_every must be an int >= 1 (steps between two "
                         f"synchronisations of the parameters), got {sync_every!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, (int, np.integer)) or warmup < 0:
        raise ValueError(f"local_sgd_warmup must be an int >= 0 (steps synchronised every "
                         f"step before Local SGD starts), got {warmup!r}")
    if outer_optimizer is None and outer_optimizer_params:
        raise ValueError("outer_optimizer_params was given without an outer_optimizer; "
                         "pass outer_optimizer='nag' (DiLoCo) or 'sgd', for instance")
    if isinstance(delay, bool) or not isinstance(delay, (int, np.integer)) \
            or not 0 <= delay <= sync_every:
        raise ValueError(f"sync_delay must be an int from 0 to sync_every ({sync_every}): "
                         f"the local steps a synchronisation's sum overlaps, got {delay!r}")
    if delay and sync_every == 1 and outer_optimizer is None:
        raise ValueError(f"sync_delay={delay} needs sync_every > 1 or an outer_optimizer")
    if warmup and sync_every == 1 and outer_optimizer is None:
        raise ValueError(f"local_sgd_warmup={warmup} needs sync_every > 1 or an "
                         "outer_optimizer: with neither, every step is synchronised anyway")


def _outer(optimizer, params: dict | None) -> mx.optimizer.Optimizer:
    """The outer optimizer, ``rescale_grad`` 1: its gradient is already an average."""
    params = dict(params or {})
    if isinstance(optimizer, mx.optimizer.Optimizer):
        if params:
            raise ValueError("outer_optimizer_params must be empty when outer_optimizer is "
                             "an Optimizer instance (give its parameters to it)")
        optimizer.rescale_grad = 1.0
        return optimizer
    if "rescale_grad" in params and params["rescale_grad"] != 1:
        raise ValueError("the outer optimizer's gradient is the average of the workers' "
                         "parameter deltas: leave its rescale_grad at 1")
    params["rescale_grad"] = 1.0
    try:
        return mx.optimizer.create(optimizer, **params)
    except (ValueError, TypeError, mx.base.MXNetError) as err:
        raise ValueError(f"outer_optimizer={optimizer!r} with {params} cannot be created: "
                         f"{err}") from None


class LocalSGD:
    """The rounds of one DistributedTrainer (see the module docstring).

    Parameters
    ----------
    kv : Backend
    prefix : str
        The trainer's key prefix; the pseudo-gradients travel under
        ``'<prefix>.outer.<position>'``.
    sync_every : int
        H, the steps of a round.
    warmup : int
        Steps synchronised every step before the first round.
    outer_optimizer : str, Optimizer or None
        None: Local SGD (the anchor moves to the workers' average).
    outer_optimizer_params : dict, optional
    compression : dict or None
        From ``check_compression``: the pseudo-gradients travel compressed with a codec
        of their own (its residuals are not the gradients').
    delay : int
        D, the local steps a synchronisation's sum overlaps (0: none).
    """

    def __init__(self, kv, prefix: str, sync_every: int, warmup: int = 0,
                 outer_optimizer=None, outer_optimizer_params: dict | None = None,
                 compression: dict | None = None, delay: int = 0):
        # settings
        self.sync_every = int(sync_every)
        self.warmup = int(warmup)
        self.delay = int(delay)
        self.kv = kv
        self._averager = _GradientAverager(kv, f"{prefix}.outer", compression,
                                           owner="DistributedTrainer (sync_every)")
        self._outer = (None if outer_optimizer is None
                       else mx.optimizer.get_updater(_outer(outer_optimizer,
                                                            outer_optimizer_params)))
        # position: steps the trainer took (warm-up included), local steps of this round
        self.steps = 0
        self.in_round = 0
        # the global parameters at the round's start, by model position, on the first
        # device; None until the first local step (taken there, lazily, so deferred
        # parameters have their shapes by then)
        self._anchors: dict[int, mx.nd.NDArray] | None = None
        self._deltas: dict[int, mx.nd.NDArray] = {}     # the pseudo-gradients' buffers
        # with a delay: each worker's parameters at the last synchronisation, and
        # whether that synchronisation's sum waits to be applied (None, 'now', 'late')
        self._at_sync: dict[int, mx.nd.NDArray] = {}
        self._pending: str | None = None
        # how many workers the last synchronisation's sum is over: its average divides
        # by them, also when it is applied after a restore onto another world size
        self._summed_over: int | None = None
        self.synchronisations = 0

    @property
    def codec(self):
        """The codec of the pseudo-gradients (its state is checkpointed), or None."""
        return self._averager.codec

    @property
    def outer_updater(self):
        """The outer optimizer's ``mx.optimizer.Updater`` (DiLoCo), or None."""
        return self._outer

    @property
    def local(self) -> bool:
        """Whether the next step is a worker's own (no per-step collective)."""
        return self.steps >= self.warmup

    def begin_step(self, params: list) -> None:
        """Before a local step's update: a round's first step keeps the anchors."""
        if self._anchors is None:
            self._anchors = {i: p.list_data()[0].copy() for i, p in enumerate(params)
                             if p.grad_req != "null"}

    def end_step(self, params: list, was_local: bool) -> None:
        """After every step: count it, apply a delayed synchronisation D local steps
        after it, and synchronise at a round's H-th local step."""
        self.steps += 1
        if not was_local:
            return
        self.in_round += 1
        if self._pending == "late" and self.in_round >= self.delay:
            self._apply(params)
        if self.in_round >= self.sync_every:
            self.synchronise(params, wait=self.delay == 0)

    def synchronise(self, params: list, wait: bool = True) -> None:
        """Steps 3-5 of the module docstring; a collective, on every rank. Nothing is
        sent when no local step was taken since the last synchronisation. Without
        ``wait`` the sum overlaps the next D local steps (module docstring); with it, a
        correction still pending is applied first, and every worker ends with the same
        parameters."""
        if wait and self._pending == "late":
            self._apply(params)
        if self.in_round == 0 or self._anchors is None:
            return
        self.in_round = 0
        self.synchronisations += 1
        positions = sorted(self._anchors)
        deltas = []
        for i in positions:
            anchor, weight = self._anchors[i], params[i].list_data()[0]
            delta = self._buffer(self._deltas, i, anchor)
            mx.nd.elemwise_sub(anchor, weight, out=delta)
            deltas.append(delta)
            if not wait:
                weight.copyto(self._buffer(self._at_sync, i, anchor))
        self._summed_over = self.kv.num_workers
        self._reduce(positions, deltas, params)
        self._pending = "now" if wait else "late"
        if wait:
            self._apply(params)

    def _apply(self, params: list) -> None:
        """Steps 4-5 on the summed pseudo-gradients: the new anchor, and every worker's
        parameters set to it ('now') or corrected by it ('late')."""
        late = self._pending == "late"
        self._pending = None
        scale = 1.0 / (self._summed_over or self.kv.num_workers)
        for i in sorted(self._anchors):
            anchor, delta = self._anchors[i], self._deltas[i]
            if scale != 1.0:
                delta *= scale
            if self._outer is None:
                anchor -= delta         # anchor - mean(anchor - w_r) == mean(w_r)
            else:
                self._outer(i, delta, anchor)
            if late:
                correction = self._at_sync[i]
                mx.nd.elemwise_sub(anchor, correction, out=correction)
                for data in params[i].list_data():
                    data += correction.as_in_context(data.context)
            else:
                for data in params[i].list_data():
                    anchor.copyto(data)

    @staticmethod
    def _buffer(buffers: dict, i: int, like: mx.nd.NDArray) -> mx.nd.NDArray:
        found = buffers.get(i)
        if found is None:
            found = buffers[i] = mx.nd.zeros(like.shape, ctx=like.context, dtype=like.dtype)
        return found

    def _reduce(self, positions: list[int], deltas: list, params: list) -> None:
        averager = self._averager

        def describe(i):
            return f"parameter #{i} ({params[i].name!r})"

        if not averager.distributed or (averager.codec is not None and averager.codec.batched):
            averager.reduce(positions, deltas, describe=describe)
        else:
            for i, delta in zip(positions, deltas):
                averager.reduce([i], [delta], describe=describe)

    # ------------------------------------------------------------ in memory
    def state_arrays(self) -> dict[str, mx.nd.NDArray]:
        """The round's live arrays by name, for ``dg.elastic.State``: the anchors, the
        outer optimizer's states, the codec's, and with an overlap the buffers of a sum
        in flight and of the parameters at its synchronisation (allocated once, so
        their names stay from the first synchronisation on, pending or not)."""
        arrays = {f"anchor.{i}": a for i, a in (self._anchors or {}).items()}
        if self.delay:
            arrays.update((f"sum.{i}", d) for i, d in self._deltas.items())
            arrays.update((f"at_sync.{i}", a) for i, a in self._at_sync.items())
        if self._outer is not None:
            for index, state in self._outer.states.items():
                arrays.update((f"outer.{index}.{j}", leaf)
                              for j, leaf in enumerate(optimizer_state_arrays(state)))
        if self.codec is not None:
            arrays.update((f"codec.{name}", a) for name, a in self.codec.state_arrays().items())
        return arrays

    def private_state_names(self) -> set[str]:
        """The names of :meth:`state_arrays` that are this rank's own: the codec's
        residuals (a parameter at the synchronisation follows the weights)."""
        codec = self.codec
        if codec is None:
            return set()
        return {f"codec.{name}" for name in codec.state_arrays() if codec.is_private(name)}

    def state_counters(self) -> dict:
        """The position, whether a sum is pending, the outer optimizer's counters and
        which of :meth:`state_arrays` exist (their shapes, for a new worker)."""
        shapes = {name: (tuple(a.shape), np.dtype(a.dtype).name)
                  for name, a in self.state_arrays().items() if not name.startswith("codec.")}
        outer = None if self._outer is None else update_counters(self._outer.optimizer)
        return {"steps": self.steps, "in_round": self.in_round,
                "synchronisations": self.synchronisations, "pending": self._pending,
                "summed_over": self._summed_over, "shapes": shapes, "outer": outer,
                "codec": None if self.codec is None else self.codec.state_counters()}

    def set_state_counters(self, saved: dict, ctx_of) -> None:
        """Put back :meth:`state_counters`; arrays made since go, those a new worker
        lacks are made (zeros on ``ctx_of(position)``, for the caller to fill)."""
        self.steps, self.in_round = saved["steps"], saved["in_round"]
        self.synchronisations, self._pending = saved["synchronisations"], saved["pending"]
        self._summed_over = saved.get("summed_over")
        shapes = saved["shapes"]

        def kept(prefix, held):
            wanted = {int(name[len(prefix):]): shape for name, shape in shapes.items()
                      if name.startswith(prefix)}
            for i in [i for i in held if i not in wanted]:
                del held[i]
            for i, (shape, dtype) in wanted.items():
                if i not in held:
                    held[i] = mx.nd.zeros(shape, ctx=ctx_of(i), dtype=dtype)
            return held

        anchors = kept("anchor.", dict(self._anchors or {}))
        self._anchors = anchors or None
        if self.delay:
            kept("sum.", self._deltas)
            kept("at_sync.", self._at_sync)
        if self._outer is not None:
            self._set_outer_counters(saved["outer"], shapes)
        if self.codec is not None:
            self.codec.set_state_counters(saved["codec"], ctx_of)

    def _set_outer_counters(self, saved: dict, shapes: dict) -> None:
        updater, opt = self._outer, self._outer.optimizer
        set_update_counters(opt, saved)
        wanted = {int(name.split(".")[1]) for name in shapes if name.startswith("outer.")}
        for index in [i for i in updater.states if i not in wanted]:
            del updater.states[index]
            updater.states_synced.pop(index, None)
        for index in wanted - set(updater.states):
            updater.states[index] = opt.create_state_multi_precision(
                index, self._anchors[index])
            updater.states_synced[index] = True

    # ------------------------------------------------------------ checkpoints
    def shared_state(self) -> dict:
        """What is the same on every rank: the position, the anchors, the outer state
        and the codec's shared state (NumPy arrays and picklable values)."""
        anchors = None if self._anchors is None else \
            {i: a.asnumpy() for i, a in self._anchors.items()}
        codec = self.codec
        pending = None
        if self._pending == "late":     # the sum in flight, the same on every rank
            pending = {i: d.asnumpy() for i, d in self._deltas.items()}
        return {"sync_every": self.sync_every, "warmup": self.warmup, "steps": self.steps,
                "in_round": self.in_round, "synchronisations": self.synchronisations,
                "anchors": anchors, "delay": self.delay, "pending": pending,
                "summed_over": self._summed_over,
                "outer": None if self._outer is None else self._outer.get_states(True),
                "codec": None if codec is None else {"type": codec.name,
                                                      "shared": codec.shared_state()}}

    def load_shared_state(self, state: dict, ctx_of: dict) -> None:
        """Restore :meth:`shared_state`; ``ctx_of[position]`` is the context of the
        parameter's first device."""
        self.steps = int(state["steps"])
        self.in_round = int(state["in_round"])
        self.synchronisations = int(state.get("synchronisations", 0))
        anchors = state["anchors"]
        self._anchors = None if anchors is None else {
            i: mx.nd.array(a, ctx=ctx_of[i], dtype=a.dtype) for i, a in anchors.items()}
        pending = state.get("pending")
        self._deltas = {} if pending is None else {
            i: mx.nd.array(d, ctx=ctx_of[i], dtype=d.dtype) for i, d in pending.items()}
        self._pending = None if pending is None else "late"
        # a checkpoint older than the field: its sum is taken as the current world's
        self._summed_over = state.get("summed_over")
        self._at_sync = {}
        if self._outer is not None and state["outer"] is not None:
            self._outer.set_states(state["outer"])
            self._outer.optimizer.rescale_grad = 1.0

    def local_state(self) -> dict:
        """What differs between ranks (besides parameters and optimizer states): the
        codec's residuals and, with a correction pending, the parameters at the last
        synchronisation."""
        at_sync = None
        if self._pending == "late":
            at_sync = {i: a.asnumpy() for i, a in self._at_sync.items()}
        return {"codec": None if self.codec is None else self.codec.local_state(),
                "at_sync": at_sync}

    def load_local_state(self, state: dict, ctx_of: dict) -> None:
        """Restore this rank's :meth:`local_state` (after :meth:`load_shared_state`); the
        codec's residuals are the caller's (they merge over ranks)."""
        at_sync = state.get("at_sync")
        if self._pending == "late":
            if at_sync is None:
                raise ValueError("the checkpoint has a synchronisation pending but no "
                                 "parameters of this rank at it")
            self._at_sync = {i: mx.nd.array(a, ctx=ctx_of[i], dtype=a.dtype)
                             for i, a in at_sync.items()}
