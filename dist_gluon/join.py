"""Uneven inputs: ``dg.Join``, so that ranks with different numbers of batches train to
the end, exactly.

Every collective of a step waits for every rank, so a rank that runs out of batches
while the others go on would leave them waiting. Inside ``with dg.Join(trainer):`` a
rank that leaves the loop early stays in ``__exit__`` and *shadows* the steps the
others still take, until every rank has left:

1. Each event of a step that communicates (a trainer's ``step``, ``allreduce_grads``
   or ``update``, a SyncBatchNorm's training forward) first *announces* itself: the
   ranks in the loop add ``[1, code, batch size]`` into one tiny sum (:data:`KEY`), the
   code naming the event (which trainer and call, which SyncBatchNorm layer); the batch
   size is that of a peer's trainer (``dist_gluon.compat``), which rescales by each
   rank's own. The ranks in the loop never wait for that sum: it rides ahead of the
   event's own collectives.
2. A rank in ``__exit__`` adds ``[0, 0, 0]`` (and, in its own slot of the N that follow,
   the number of events it announced, +1) and waits for the total. No rank in the loop:
   every rank has left, and all return together (the most events: the last to leave).
   Otherwise the code (the total over the number of ranks still in the loop) says which
   event to shadow, and it issues that event's collectives with nothing of its own: a
   trainer step with batch size 0 and zero (stale) gradients, then the same update as
   the others (so the weights, the optimizer states and the sync check's counters stay
   equal everywhere); a Module's update with zero gradients and weight 0; a
   SyncBatchNorm forward with a sample count of 0 (its running statistics move towards
   the global ones like everyone's) and zeros in its backward collective.
3. The step's header sums the batch sizes, so the others divide by the samples that are
   really there, and the freshness counts are compared with the number of ranks still
   in the loop (read from the announcement, only when some count falls short): one
   step equals one process on the concatenation of the batches of the ranks that still
   have one.

Before any rank has left, a step costs one extra sum of ``3 + N`` floats (N workers) per
announced event, which nobody waits for.
"""
from __future__ import annotations

import contextlib
import weakref

import mxnet as mx
import numpy as np

KEY = "dg.join"

# announced event codes: a SyncBatchNorm layer number n is 1 + 2 n (+1 when recording,
# i.e. a backward pass follows); trainer calls are negative, -(1 + 8 t + call)
_CALLS = ("step", "step_ignore_stale", "allreduce_grads", "update", "update_ignore_stale")

_current: Join | None = None
# SyncBatchNorm layers by number, as seen inside any block of this process, so that a
# rank shadows a layer's forward in a later epoch too
_layers: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


class JoinError(RuntimeError):
    """A rank that had joined cannot shadow what the ranks still in the loop do."""


class Join:
    """Lets ranks with different numbers of batches train to the end of a loop.

    A rank that leaves the ``with`` block's loop while other ranks still have batches
    waits in ``__exit__``, taking part in every step the others take with zero
    samples: batch size 0 in the step's header, zero gradients, the same update (the
    weights stay equal on every rank), a sample count of 0 in every SyncBatchNorm
    layer (its running statistics are updated from the global ones as everyone's),
    the DG_CHECK_SYNC comparisons. A step the others take equals one process trained
    on the concatenation of the batches of the ranks that still have one. When every
    rank has left the loop, all return together. The block can be entered again (each
    epoch). On one process it does nothing.

    Parameters
    ----------
    *trainers : DistributedTrainer, DistributedOptimizer, or the DistributedTrainer of
        dist_gluon.compat.horovod or .byteps
        Every trainer stepped inside the block (a GAN's two), in the same order on every
        rank; a Module's DistributedOptimizer, with ``mod.fit`` inside the block. A rank
        that has left steps a peer's trainer with the mean batch size of the ranks still
        in the loop (the peers rescale by a rank's own batch size).

    Attributes
    ----------
    last_joined : int or None
        After the block (or :meth:`finish`): the last rank to leave the loop, the same
        on every rank (the one that took part in the most steps; the highest of a tie).

    Examples
    --------
    >>> for epoch in range(epochs):
    ...     with dg.Join(trainer):
    ...         for data, label in loader:     # 10 batches on rank 0, 7 on rank 1
    ...             with autograd.record():
    ...                 loss = loss_fn(net(data), label)
    ...             loss.backward()
    ...             trainer.step(data.shape[0])

    Notes
    -----
    A rank shadows what it has done itself inside some block: a SyncBatchNorm layer
    it never ran a training forward through, or a collective of the script's own (a
    ``kv.pushpull`` under a key of its own), cannot be shadowed and ends the job with
    a :class:`JoinError` naming it, instead of a hang.
    """

    def __init__(self, *trainers):
        from .compat._training import PeerOptimizer, PeerTrainer
        from .optimizer import DistributedOptimizer
        from .trainer import DistributedTrainer
        if not trainers:
            raise ValueError("dg.Join needs the trainers stepped inside the block, "
                             "e.g. dg.Join(trainer) or dg.Join(g_trainer, d_trainer)")
        for trainer in trainers:
            if not isinstance(trainer, (DistributedTrainer, PeerTrainer,
                                        DistributedOptimizer)):
                raise TypeError(f"dg.Join takes dist_gluon.DistributedTrainer objects (or "
                                "the DistributedTrainer of dist_gluon.compat.horovod or "
                                ".byteps, or a DistributedOptimizer of the Module API), "
                                f"got {type(trainer).__name__}: a gluon.Trainer does not "
                                "announce its steps")
        kvs = {id(t.kv) for t in trainers}
        if len(kvs) > 1:
            raise ValueError("the trainers given to dg.Join communicate through different "
                             "backends; give each block the trainers of one backend")
        local_rounds = [t for t in trainers if getattr(t, "sync_every", 1) > 1]
        if local_rounds:
            raise ValueError("dg.Join does not shadow Local SGD rounds yet (a trainer with "
                             f"sync_every={local_rounds[0].sync_every}); pad the shares "
                             "(dist_gluon.ShardSampler) instead")
        self._trainers = list(trainers)
        self._peers = [isinstance(t, (PeerTrainer, PeerOptimizer)) for t in trainers]
        self._optimizers = [isinstance(t, DistributedOptimizer) for t in trainers]
        # the indices a Module's optimizer updated in its current step
        self._updated: dict[int, set] = {}
        self._kv = trainers[0].kv
        # the keys a rank that has left can shadow: the trainers' (gradients, header,
        # codecs, sync check), SyncBatchNorm's and the announcements'
        self._own_keys = tuple(f"{t._dg_prefix}." if isinstance(t, DistributedOptimizer)
                               else t._averager.key("") for t in trainers) + ("syncbn.", KEY)
        self._note: mx.nd.NDArray | None = None     # the announcement's sum, reused
        self._codes: dict[int, mx.nd.NDArray] = {}  # [1, code, 0...] made once per code
        self._shadowing = False
        self._in_loop = 0           # ranks in the loop at the event being shadowed
        self._events = 0            # events this rank announced in the block's loop
        self.last_joined: int | None = None

    @property
    def trainers(self) -> list:
        """The trainers whose steps a rank that has left shadows, in announcement order."""
        return list(self._trainers)

    # ------------------------------------------------------------ the block
    def __enter__(self) -> Join:
        global _current
        if _current is not None:
            raise RuntimeError("dg.Join blocks do not nest: give one block every trainer, "
                               "dg.Join(g_trainer, d_trainer)")
        # dist_async: a rank that has left simply stops pushing, nobody waits for it
        self._events, self.last_joined, self._updated = 0, None, {}
        if self._kv.num_workers > 1 and self._kv.type != "dist_async":
            _current = self
        else:
            self.last_joined = self._kv.rank
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        global _current
        if _current is not self:
            return False
        try:
            if exc_type is None:
                self._shadow_until_all_left()
        finally:
            _current = None
        return False

    def finish(self) -> int:
        """This rank has run out of batches: shadow the other ranks' steps until every
        rank has left, end the block's work here, and return the last rank to leave
        (``hvd.join()`` inside a block; leaving the block does the same)."""
        global _current
        if _current is not self:
            return self.last_joined
        try:
            return self._shadow_until_all_left()
        finally:
            _current = None

    # ------------------------------------------------------------ announcements
    def _announce(self, code: int, batch_size: float = 0.0) -> None:
        """Add ``[1, code, batch_size]`` into the announcement sum (queued; nobody waits
        here)."""
        kv = self._kv
        if self._note is None:
            self._note = mx.nd.zeros((3 + kv.num_workers,), dtype="float32")
        mine = self._codes.get(code)
        if mine is None:
            mine = self._codes[code] = mx.nd.array(
                [1.0, float(code), 0.0] + [0.0] * kv.num_workers, dtype="float32")
        mine.copyto(self._note)
        if batch_size:
            self._note[2] = float(batch_size)
        self._events += 1
        kv.pushpull(KEY, self._note, priority=2)

    def _ranks_in_loop(self) -> int:
        """The number of ranks that announced the current event (a wait for the
        announcement's sum, which was sent before the event's own collectives)."""
        if self._shadowing:
            return self._in_loop
        return int(round(float(self._note[0].asscalar())))

    def _joined_ranks(self) -> list[int]:
        values = self._note.asnumpy()
        return [r for r in range(self._kv.num_workers) if values[3 + r] > 0]

    # ------------------------------------------------------------ hooks (ranks in the loop)
    def before_trainer_call(self, trainer, call: str, batch_size: float = 0.0) -> None:
        if self._shadowing:
            return
        index = next((i for i, t in enumerate(self._trainers) if t is trainer), None)
        if index is None:
            return
        self._announce(-(1 + 8 * index + _CALLS.index(call)), batch_size)

    def before_optimizer_update(self, optimizer, index) -> None:
        """A Module's update calls the optimizer once per parameter (or group): the
        first call of a step (an index this step has not seen yet comes again, as
        the gradient averager counts steps) announces the whole step."""
        if self._shadowing:
            return
        number = next((i for i, t in enumerate(self._trainers) if t is optimizer), None)
        if number is None:
            return
        first = index[0] if isinstance(index, (list, tuple)) else index
        seen = self._updated.setdefault(number, set())
        if seen and first not in seen:
            seen.add(first)
            return
        seen.clear()
        seen.add(first)
        self._announce(-(1 + 8 * number + _CALLS.index("update")))

    def before_syncbn_forward(self, layer, number: int, recording: bool) -> None:
        if self._shadowing:
            return
        _layers[number] = layer
        self._announce(1 + 2 * number + int(recording))

    def before_foreign_collective(self, key) -> None:
        """A collective of the script's own inside the block: if some rank has joined,
        it cannot shadow it, and every rank raises instead of waiting forever."""
        if self._shadowing:
            return
        self._announce(0)
        joined = self._joined_ranks()
        if joined:
            raise JoinError(
                f"the collective under key {key!r} cannot be shadowed by rank(s) {joined}, "
                "which had already left the loop of the dg.Join block: inside the block "
                "only the trainers' steps and SyncBatchNorm communicate. Make that "
                "collective outside the block, or give every rank the same number of "
                "batches (dist_gluon.ShardSampler pads the shares)")

    # ------------------------------------------------------------ a rank that has left
    def _shadow_until_all_left(self) -> int:
        """Shadow the others' events until every rank has left; returns the last rank
        to leave (the one that announced the most events; the highest such rank)."""
        kv = self._kv
        # This rank's last step may still have SyncBatchNorm backward collectives to
        # issue (MXNet runs those functions in its own threads once their inputs are
        # computed): they must go out before the shadows' collectives under the same
        # keys, which would otherwise be summed with the others' last real ones.
        mx.nd.waitall()
        note = mx.nd.zeros((3 + kv.num_workers,), dtype="float32")
        # this rank has left, after taking part in that many events (+1: never 0)
        note[3 + kv.rank] = 1.0 + self._events
        self._shadowing = True
        try:
            while True:
                total = note.copy()
                kv.pushpull(KEY, total, priority=2)
                values = total.asnumpy()
                in_loop = int(round(float(values[0])))
                if in_loop == 0:
                    marks = values[3:]
                    self.last_joined = max(range(kv.num_workers),
                                           key=lambda r: (marks[r], r))
                    break
                self._in_loop = in_loop
                self._shadow(int(round(float(values[1]) / in_loop)), values)
        finally:
            self._shadowing = False
        self._note = None
        return self.last_joined

    def _shadow(self, code: int, values: np.ndarray) -> None:
        rank = self._kv.rank
        if code == 0:
            raise JoinError(
                f"rank {rank} had left the loop of its dg.Join block when the ranks still "
                "in it made a collective of the script's own (a kv.pushpull under a key of "
                "its own), which it cannot shadow; they name the key")
        if code > 0:
            number, recording = divmod(code - 1, 2)
            layer = _layers.get(number)
            if layer is None:
                raise JoinError(
                    f"rank {rank} had left the loop of its dg.Join block and cannot shadow "
                    f"SyncBatchNorm layer syncbn.{number}: it never ran a training "
                    "forward through that layer inside a dg.Join block")
            layer._shadow_forward(bool(recording))
            return
        index, call = divmod(-code - 1, 8)
        trainer = self._trainers[index]
        name = _CALLS[call]
        if self._optimizers[index]:
            _shadow_module_update(trainer, peer=self._peers[index])
            return
        # a DistributedTrainer sums the batch sizes (this rank adds 0); a peer's trainer
        # rescales by the rank's own, here the mean of the ranks still in the loop
        batch = float(values[2]) / self._in_loop if self._peers[index] else 0
        _amp_scale_of_this_step(trainer)
        if name.startswith("step"):
            with _codec_feedback_kept(trainer.codec):
                trainer.step(batch, ignore_stale_grad=name.endswith("stale"))
        elif name == "allreduce_grads":
            with _codec_feedback_kept(trainer.codec):
                trainer.allreduce_grads()
        else:
            trainer.update(batch, ignore_stale_grad=name.endswith("stale"))


def _amp_scale_of_this_step(trainer) -> None:
    """With AMP, the gradient scale of the step being shadowed: ``amp.scale_loss`` sets
    ``trainer._scale`` from the loss scale at every forward, which a rank that has left
    no longer runs; a scale kept from its last own step (before a change of the loss
    scale) would update its weights differently from the others'."""
    scaler = getattr(trainer, "_amp_loss_scaler", None)
    if scaler is not None:
        trainer._scale = trainer._amp_original_scale / scaler.loss_scale


# The codec state that is this worker's own (error feedback: 2-bit's residuals,
# PowerSGD's and BytePS's errors, BytePS's momentum), by the prefix of its name in
# Codec.state_arrays(); the rest (PowerSGD's Q, BytePS's server error and NAG) is the
# same on every rank and moves with the sums.
_OWN_CODEC_STATE = ("residual.", "error.", "momentum.")


@contextlib.contextmanager
def _codec_feedback_kept(codec):
    """A shadowed step through a codec with error feedback: the rank's own feedback is
    zero for the step, so that its zero gradient compresses to zeros and adds nothing,
    and is put back afterwards, unchanged (an array made in the step is left at zero)."""
    if codec is None:
        yield
        return
    kept = {}
    for name, array in codec.state_arrays().items():
        if name.startswith(_OWN_CODEC_STATE):
            kept[name] = array.copy()
            array[:] = 0
    try:
        yield
    finally:
        for name, array in codec.state_arrays().items():
            if name in kept:
                kept[name].copyto(array)
            elif name.startswith(_OWN_CODEC_STATE):
                array[:] = 0


def _shadow_module_update(optimizer, peer: bool) -> None:
    """The Module's ``update()`` with zero gradients and a weight (batch size) of 0:
    the sums get nothing from this rank, which applies the same update as the others."""
    module = optimizer._dg_installer
    if module is None:
        raise JoinError("a rank that had left the loop of its dg.Join block cannot take "
                        "part in the Module's update: its DistributedOptimizer was never "
                        "installed in a Module (mod.init_optimizer or mod.fit)")
    for grads in module._exec_group.grad_arrays:
        for grad in grads:
            if grad is not None:
                grad[:] = 0
    inner = optimizer._dg_wrapped_optimizer
    rescale_grad = inner.rescale_grad
    if not peer:
        # DistributedOptimizer weighs a rank by 1 / rescale_grad, its batch size
        inner.rescale_grad = float("inf")
    averager = optimizer._dg_averager
    try:
        with _codec_feedback_kept(averager.codec if averager is not None else None):
            module.update()
    finally:
        inner.rescale_grad = rescale_grad


def optimizer_update(optimizer, index) -> None:
    """Hook of DistributedOptimizer: announce a Module's step inside a Join block."""
    if _current is not None:
        _current.before_optimizer_update(optimizer, index)


def current() -> Join | None:
    """The Join block this process is in (None outside one, or on one process)."""
    return _current


def trainer_call(trainer, call: str, ignore_stale_grad: bool = False,
                 batch_size: float = 0.0) -> None:
    """Hook of the trainers: announce ``call`` ('step', 'allreduce_grads', 'update') of
    ``trainer`` inside a Join block (with the batch size a peer's trainer rescales by)."""
    if _current is not None:
        if ignore_stale_grad and call in ("step", "update"):
            call += "_ignore_stale"
        _current.before_trainer_call(trainer, call, batch_size)


def check_collective(kv, key) -> None:
    """Hook of ``Backend.pushpull``: a key that no trainer or layer of the Join block
    owns is the script's own collective (see :meth:`Join.before_foreign_collective`)."""
    join = _current
    if join is None or kv is not join._kv or join._shadowing:
        return
    keys = key if isinstance(key, (list, tuple)) else (key,)
    foreign = [k for k in keys if not (isinstance(k, str) and k.startswith(join._own_keys))]
    if foreign:
        join.before_foreign_collective(foreign[0])


def syncbn_forward(layer, number: int, recording: bool) -> None:
    """Hook of SyncBatchNorm: announce a training forward of layer ``number``."""
    if _current is not None:
        _current.before_syncbn_forward(layer, number, recording)


def ranks_stepping(trainer, counts) -> int:
    """The number of ranks that step ``trainer`` now: every worker, or inside a Join
    block the ranks still in its loop (the rest count zero in ``counts``, the step's
    freshness counts; read only when some count is short of the workers)."""
    workers = trainer.kv.num_workers
    if _current is None or not any(t is trainer for t in _current._trainers):
        return workers
    if len(counts) and float(np.min(counts)) >= workers:
        return workers
    return _current._ranks_in_loop()
