"""DistributedTrainer: gluon.Trainer whose gradients are averaged over workers."""
from __future__ import annotations

import os
import pickle
import tempfile
import warnings

import mxnet as mx
from mxnet import gluon

from . import amp, async_updates, sharding
from . import join as _join
from . import syncbn as _syncbn
from . import timeline as _timeline
from .averaging import _GradientAverager, check_compression, check_predivide, claim_prefix
from .backends import resolve
from .broadcast import (
    ParameterSync,
    optimizer_state_arrays,
    parameter_list,
    set_update_counters,
    update_counters,
)
from .devices import copy_from_first, sum_into_first
from .freshness import local_freshness, settle, zero_stale
from .local_sgd import LocalSGD, check_sync_every
from .syncheck import SyncCheck

# Tensors with more elements than this are updated one per optimizer call; smaller ones
# are aggregated (see _SizeGroupedUpdater).
_AGGREGATE_BELOW = 1 << 16


class TrainerBase(gluon.Trainer):
    """What DistributedTrainer and the peers' trainers share: a ``gluon.Trainer`` with no
    MXNet kvstore, whose gradients go through :mod:`dist_gluon.averaging`.

    Two orders, one mapping. The optimizer's indices (its states, ``save_states`` and
    ``load_states`` files, the updater) are gluon.Trainer's for the same ``params``
    argument: a ParameterDict or dict sorted by name, a list as given. So a state file
    moves between ``gluon.Trainer``, horovod.mxnet's and BytePS's trainers and ours.
    The communication keys are positions in the model's own order
    (:func:`~dist_gluon.broadcast.parameter_list`), which every rank agrees on even where
    MXNet 1.x named the parameters differently (``dense0_`` on one rank, ``dense2_`` on
    another): :attr:`model_params` lists the parameters by position.

    Both GPU layouts work: one process per device, or one process driving several
    (parameters initialised on a context list, as with MXNet's ``device`` kvstore).
    With several devices a worker first sums its devices' gradients on the first
    device, sends that one sum per tensor, and copies the result back to every device,
    whose own updater then applies it: N workers of D devices on B samples each train
    as one process on the N*D*B samples.

    A parameter's gradient is fresh if it is fresh on any rank (:mod:`dist_gluon.freshness`):
    a rank whose backward did not reach a parameter sends zeros for it, the step's small
    header array tells every rank on how many ranks each parameter was fresh, and every
    rank then updates (or, with ``ignore_stale_grad=True``, skips) the same parameters.

    Subclasses pass their :class:`~dist_gluon.averaging._GradientAverager`, take the
    gradients to send from :meth:`_grad_entries` (after :meth:`_submit_header` where
    the ranks are several) and call :meth:`_spread_grads` after the sums.
    """

    def __init__(self, params, optimizer, optimizer_params, averager: _GradientAverager,
                 owner: str):
        model_order = parameter_list(params)
        super().__init__(params if isinstance(params, (dict, gluon.ParameterDict))
                         else model_order, optimizer, optimizer_params, kvstore=None,
                         update_on_kvstore=False)
        self._averager = averager
        self._kv = averager.kv
        self._model_params = model_order
        # this step's freshness (model order): this rank's flags, read once per step
        # before anything is zeroed; the step's header array in flight; and, once it
        # arrived, the number of ranks where each parameter was fresh
        self._step_fresh: list[bool] | None = None
        self._header: mx.nd.NDArray | None = None
        self._fresh_counts = None
        # AMP (dist_gluon.amp): the header's sum of the batch sizes once it arrived, and
        # on how many ranks the step's gradients overflowed (None: gluon decides alone)
        self._batch_total: float | None = None
        self._overflows: float | None = None
        self._amp_skipped = False       # the last step overflowed: no codec, round, check
        # DG_CHECK_SYNC: the ranks compare their weights every N steps (syncheck.py)
        self._sync_check = SyncCheck(self._kv, f"{averager.prefix}.sync")
        # a Local SGD step is this worker's own: gradients summed over its devices only,
        # gluon's freshness semantics (dist_gluon.local_sgd)
        self._alone = False

    def _step_ended(self) -> None:
        _syncbn.step_ended()
        # horovod tunes its cycle on the first steps (backends/horovod_tuning.py); not
        # while ranks shadow each other's steps (dg.Join), whose counts differ
        if self._averager.distributed and _join.current() is None:
            self._kv.step_ended(self)

    @property
    def kv(self):
        """The backend this trainer communicates through."""
        return self._kv

    @property
    def model_params(self) -> list:
        """The parameters in the model's own order: position ``i`` travels under key
        ``'<prefix>.<i>'``. ``self._params`` (the optimizer's order) is gluon.Trainer's."""
        return list(self._model_params)

    @property
    def codec(self):
        """The compression codec (its state is checkpointed), or None."""
        return self._averager.codec

    @property
    def updates_on_servers(self) -> bool:
        """Whether the servers update the weights (dist_async) instead of the workers."""
        return False

    @property
    def servers_hold_weights(self) -> bool:
        """dist_async: whether the servers hold weights since this trainer's first step."""
        return False

    def extra_state(self) -> tuple[dict[str, mx.nd.NDArray], dict]:
        """What training continues from besides the parameters and the optimizer's
        states and counters, for ``dg.elastic.State``'s commits in memory: the live
        arrays by name (the codec's residuals, and with ``sync_every`` the round's
        anchor, outer optimizer states and a sum in flight), which the caller copies
        on MXNet's engine and copies back, and the picklable counters (the position in
        the round, the sync check's step count, which of those arrays exist and their
        shapes). :meth:`set_extra_counters` puts the counters back. Every counter that
        decides when the ranks meet in a collective is here, so that ranks restored or
        healed from a peer agree on it."""
        arrays, counters = {}, {"check": self._sync_check.steps}
        codec = self._averager.codec
        if codec is not None:
            arrays.update((f"codec.{name}", a) for name, a in codec.state_arrays().items())
            counters["codec"] = codec.state_counters()
        if amp.loss_scaler(self) is not None:
            counters["amp"] = amp.state(amp.loss_scaler(self))
        return arrays, counters

    def set_extra_counters(self, counters: dict) -> None:
        """Put back the counters of :meth:`extra_state` (after its arrays, on a restore;
        before them, on a new worker): arrays made since they were taken are dropped,
        and those this trainer lacks are made, zeros on the parameter's first device,
        for the caller to fill."""
        self._sync_check.steps = counters.get("check", self._sync_check.steps)
        codec = self._averager.codec
        if codec is not None and "codec" in counters:
            codec.set_state_counters(counters["codec"], self._first_context)
        amp.set_state(amp.loss_scaler(self), counters.get("amp"))

    def private_state_names(self) -> set[str]:
        """The names of :meth:`extra_state`'s arrays that are this rank's own (a codec's
        residuals: what this rank held back), which a worker healing from a peer must
        not copy; the others are the same on every rank, or follow the weights."""
        codec = self._averager.codec
        if codec is None:
            return set()
        return {f"codec.{name}" for name in codec.state_arrays() if codec.is_private(name)}

    def _first_context(self, position):
        """The first device of the parameter at model ``position``."""
        if isinstance(position, int) and 0 <= position < len(self._model_params):
            return self._model_params[position].list_ctx()[0]
        return self._contexts[0]

    def optimizer_positions(self) -> list[int]:
        """The model position of each optimizer index: ``optimizer_positions()[i]`` is
        where ``self._params[i]`` sits in :attr:`model_params`."""
        return positions_in(self._params, self._model_params)

    def _init_kvstore(self):
        # Communication goes through self._kv, never through an MXNet kvstore; gluon's
        # version would also read param.data(), which fails before a deferred model's
        # first forward (e.g. in load_states right after a restart).
        self._kvstore = None
        self._update_on_kvstore = False
        self._distributed = False
        self._kv_initialized = True

    def _grad_entries(self) -> list[tuple[int, mx.nd.NDArray]]:
        """(position, gradient) of every trainable parameter, in the model's order; with
        several devices the gradient is the sum of the devices', in the first device's
        array (queued on the engine: nothing waits here). Where several gradients are
        summed (devices or ranks), a stale one is zeroed first: it counts zero."""
        fresh = self._freshness()
        summed = self._kv.num_workers > 1 and not self._alone
        entries = []
        for i, param in enumerate(self._model_params):
            if param.grad_req == "null":
                continue
            grads = param.list_grad()
            if (summed and not fresh[i]) or (len(grads) > 1 and fresh[i]):
                zero_stale(param)
            if len(grads) > 1:
                sum_into_first(grads)
            entries.append((i, grads[0]))
        return entries

    def _freshness(self) -> list[bool]:
        """This rank's freshness of each parameter this step (model order), read before
        the first gradient is zeroed or summed."""
        if self._step_fresh is None:
            self._step_fresh = local_freshness(self._model_params)
        return self._step_fresh

    def _submit_header(self, batch_size: float = 0.0) -> None:
        """Start the sum of this step's header over the workers: the batch sizes and
        the freshness counts (:meth:`~dist_gluon.averaging._GradientAverager.submit_step`).
        Sent before the gradients, with the highest priority."""
        overflow = None
        if amp.loss_scaler(self) is not None:
            fresh = self._freshness()
            overflow = amp.overflow_flag([g for i, p in enumerate(self._model_params)
                                          if p.grad_req != "null" and fresh[i]
                                          for g in p.list_grad()])
        self._header = self._averager.submit_step(batch_size, self._freshness(), overflow)

    def _read_header(self) -> float:
        """Wait for the header (the step's one wait) and keep the freshness counts (and
        with AMP the number of ranks that overflowed); returns the sum of the batch
        sizes. Read already this step (AMP with a codec): no wait."""
        if self._header is None and self._fresh_counts is not None:
            return self._batch_total
        _timeline.submitted()
        values = self._header.asnumpy()
        _timeline.header_arrived()
        self._header = None
        if amp.loss_scaler(self) is not None:
            self._overflows, values = float(values[-1]), values[:-1]
        self._fresh_counts = values[1:]
        self._batch_total = float(values[0])
        return self._batch_total

    def _amp_skips_reduce(self) -> bool:
        """With AMP and a codec on several workers, before the codec runs: wait for the
        header, and tell whether the step overflowed on any rank (then no gradient is
        sent and the codec's state stays as it was); else the codec sees the gradients
        unscaled (dist_gluon.amp)."""
        scaler = amp.loss_scaler(self)
        if scaler is None or self._averager.codec is None:
            self._averager.loss_scale = 1.0
            return False
        if self._header is None and self._fresh_counts is None:
            self._submit_header()       # allreduce_grads(): before update()'s header
        self._read_header()
        self._averager.loss_scale = scaler.loss_scale
        return self._overflows > 0

    def _update(self, ignore_stale_grad=False):
        try:
            if self._kv.num_workers > 1 and not self._alone:
                if self._fresh_counts is None:
                    if self._header is None:
                        self._submit_header()
                    self._read_header()
                settle(self._model_params, self._fresh_counts, ignore_stale_grad,
                       _join.ranks_stepping(self, self._fresh_counts),
                       self._stale_positions_by_rank, self._describe,
                       step=self._optimizer.num_update + 1)
            elif len(self._contexts) > 1 and ignore_stale_grad:
                # one process, several devices: fresh on one device is fresh on all,
                # since every device now holds the sum
                settle(self._model_params, [float(f) for f in self._freshness()], True, 1,
                       list, self._describe)
            overflows = self._overflows
        finally:
            self._step_fresh = self._header = self._fresh_counts = None
            self._overflows = None
        self._amp_skipped = overflows is not None and overflows > 0
        if overflows is not None:
            # every rank's verdict, the same on every rank; gluon's own check is skipped
            amp.record(amp.loss_scaler(self), self._amp_skipped)
            if self._amp_skipped:
                return
        with _timeline.span("optimizer update", "update"), \
                amp.decided(self, overflows is not None):
            super()._update(ignore_stale_grad)
        if not self._alone:
            # a Local SGD worker's own steps differ between ranks by design
            self._sync_check.after_step(self._model_params, self._optimizer_states,
                                        self._describe)

    def _optimizer_states(self) -> dict[int, list]:
        """The optimizer state arrays of each parameter, by model position."""
        updater = self._updaters[0]
        # DistributedTrainer wraps its updaters for the length of an update
        states = getattr(updater, "_updater", updater).states
        return {p: optimizer_state_arrays(states.get(i))
                for i, p in enumerate(self.optimizer_positions()) if p is not None}

    def _states_loaded(self) -> None:
        """Called once states were loaded into the updaters (set_trainer_states)."""

    def _last_grad_written(self):
        """The gradient a backward writes last: the first trainable parameter's."""
        return next((p.list_grad()[0] for p in self._model_params
                     if p.grad_req != "null" and p._data is not None), None)

    def _stale_positions_by_rank(self) -> list[list[int]]:
        """Each rank's stale parameters this step (a collective, for an error message)."""
        fresh = self._freshness()
        mine = [i for i, param in enumerate(self._model_params)
                if param.grad_req != "null" and not fresh[i]]
        return self._kv.allgather_object(mine)

    def _tell_codec_learning_rate(self) -> None:
        """A codec whose error feedback follows the learning rate (BytePS's, which scale
        the kept error by the previous rate over this one) hears this step's rate."""
        tell = getattr(self._averager.codec, "set_learning_rate", None)
        if tell is not None:
            tell(self.learning_rate)

    def _spread_grads(self) -> None:
        """Copy every summed gradient from the first device to the others."""
        if len(self._contexts) < 2:
            return
        for param in self._model_params:
            if param.grad_req != "null":
                copy_from_first(param.list_grad())

    def _describe(self, position: int) -> str:
        return f"parameter #{position} ({self._model_params[position].name!r})"

    def _load_rank0_states(self, fname: str) -> None:
        """``load_states`` of a file only rank 0 reads: its bytes and rank 0's order
        travel to every rank, and a rank whose gluon order differs (other names) maps
        each state through the model position to its own index."""
        payload = None
        if self._kv.rank == 0:
            try:
                with open(fname, "rb") as f:
                    payload = ("ok", f.read(), self.optimizer_positions())
            except OSError as err:
                payload = ("error", f"rank 0 cannot read trainer states {fname!r}: {err}",
                           None)
        if self._kv.num_workers > 1:
            payload = self._kv.broadcast_object(payload)
        status, data, positions = payload
        if status != "ok":
            raise FileNotFoundError(data)
        mine = self.optimizer_positions()
        if positions != mine:
            data = pickle.dumps(remap_states(pickle.loads(data),
                                             index_mapping(positions, mine)), protocol=4)
        set_trainer_states(self, data)


def positions_in(items: list, order: list) -> list[int | None]:
    """The position in ``order`` of each of ``items`` (by identity; None where absent)."""
    position = {id(p): i for i, p in enumerate(order)}
    return [position.get(id(p)) for p in items]


def index_mapping(saved: list, mine: list) -> dict[int, int]:
    """Saved optimizer index -> this trainer's index, given the model position of each
    index on both sides; a saved index whose position this trainer lacks is left out."""
    index_of = {position: i for i, position in enumerate(mine)}
    return {old: index_of[p] for old, p in enumerate(saved) if p in index_of}


def set_trainer_states(trainer: gluon.Trainer, blob: bytes) -> None:
    """``trainer.load_states`` of ``blob`` (the bytes of a states file), for any
    gluon.Trainer. Where updates run on the workers it skips gluon's kvstore set-up,
    which reads every parameter and so fails before a deferred model's first forward."""
    if trainer._kv_initialized and trainer._update_on_kvstore:
        with tempfile.NamedTemporaryFile(suffix=".states", delete=False) as tmp:
            tmp.write(blob)
        try:
            gluon.Trainer.load_states(trainer, tmp.name)
        finally:
            os.unlink(tmp.name)
        return
    for updater in trainer._updaters:
        updater.set_states(blob)
        updater.optimizer = trainer._updaters[0].optimizer
    trainer._optimizer = trainer._updaters[0].optimizer
    trainer._optimizer.param_dict = dict(enumerate(trainer._params))
    if isinstance(trainer, TrainerBase):
        trainer._states_loaded()


def remap_states(states, mapping: dict[int, int]):
    """Updater states as ``gluon.Trainer.save_states`` writes them (a dict of index ->
    state, or ``(that dict, optimizer)``) with every index ``i`` renamed ``mapping[i]``,
    the optimizer's per-index update counts (Adam's bias correction) and index-keyed
    lr/wd multipliers included. An index missing from ``mapping`` is a KeyError."""
    optimizer = None
    if isinstance(states, tuple) and len(states) == 2:
        states, optimizer = states
    renamed = {mapping[index]: state for index, state in states.items()}
    if optimizer is None:
        return renamed
    counters = update_counters(optimizer)
    counters["tables"] = {device: {mapping.get(i, i): n for i, n in table.items()}
                          for device, table in counters["tables"].items()}
    set_update_counters(optimizer, counters)
    for table in ("lr_mult", "wd_mult"):
        values = getattr(optimizer, table)
        setattr(optimizer, table, {mapping.get(k, k) if isinstance(k, int) else k: v
                                   for k, v in values.items()})
    return renamed, optimizer


class DistributedTrainer(TrainerBase):
    """A ``gluon.Trainer`` for data-parallel training on any dist_gluon backend.

    Each worker calls ``step(batch_size)`` with its own batch size: the number of
    samples its loss was summed over. The gradients are summed over the workers, and so
    are the batch sizes (one tiny extra value that travels with the gradients, in the
    same round trip); the optimizer then rescales the summed gradients by ``1 / (sum of
    the batch sizes)``. So the workers train exactly like one process on the
    concatenation of their samples, also when their batch sizes differ (the last,
    partial batch of an epoch): N workers on B samples each are one process on N*B.

    ``allreduce_grads()`` followed by ``update(batch_size)`` (to clip the gradients in
    between, for instance) gives the same result: after ``allreduce_grads()`` every
    rank holds the sum of every worker's gradients, which is one process's gradient of
    the whole global batch, and ``update`` sums the batch sizes (one small collective)
    before it rescales.

    Row-sparse gradients (``gluon.nn.Embedding(..., sparse_grad=True)``) are summed
    with the cost of the rows in use (:mod:`dist_gluon.sparse`): every rank ends with the
    rows of all workers' batches, as one process would, so lazy updates (SGD, Adam with
    ``lazy_update=True``) touch the same rows everywhere. Compression applies to the
    dense gradients only.

    With BatchNorm this holds only for :class:`~dist_gluon.SyncBatchNorm` layers, whose
    statistics are those of all workers' samples together (and whose running
    statistics are the same on every rank). ``gluon.nn.BatchNorm`` normalises each
    worker's batch with that batch's own mean and variance, so the gradients are exact
    sums of what each worker computed, but not one process's gradients of the
    concatenated batch; and each rank updates its own running statistics (a
    checkpoint keeps rank 0's). ``dist_gluon.convert_sync_batchnorm(net)`` converts a
    network's BatchNorm layers.

    Rank 0's weights reach every rank: at construction for initialised parameters and
    at the first forward for deferred ones. The model is checked across ranks first: a
    different parameter count, shape, dtype or grad_req raises a
    :class:`~dist_gluon.broadcast.ModelMismatchError` on every rank. Updates run on the
    workers, except on ``dist_async``. On one process no collective is issued.

    On ``dist_async`` (MXNet's asynchronous parameter server) the servers update
    instead: ``step(batch_size)`` pushes this worker's gradient divided by its own batch
    size, the servers apply it at once as one optimizer step, and the worker pulls the
    current weights; nobody waits for anybody. The learning rate is then that of one
    process on this worker's batch (not scaled with the number of workers), the
    optimizer and its state live on the servers, and compression,
    ``gradient_predivide_factor`` and ``allreduce_grads()``/``update()`` are refused;
    see :mod:`dist_gluon.async_updates`.

    Parameters
    ----------
    params : ParameterDict, dict or list of Parameter
        As in ``gluon.Trainer``, whose parameter order the optimizer states follow (a
        dict sorted by name), so ``save_states`` files and ``load_states`` work across
        both; tensors travel keyed by position in the model's own order, never by name.
    optimizer : str or mx.optimizer.Optimizer
    optimizer_params : dict, optional
        As in ``gluon.Trainer``.
    kv : backend, backend name, or None
        None picks the backend from the environment (``dist_gluon.create()``).
    compression : None, 'fp16', '2bit', 'powersgd' or dict
        'fp16': gradients travel as float16 and come back in their own dtype.
        '2bit' or ``{'type': '2bit', 'threshold': 0.5, 'min_size': 0}``: MXNet's 2-bit
        quantisation with error feedback, packed in both directions.
        'powersgd' or ``{'type': 'powersgd', 'rank': 4, 'warmup_steps': 0, ...}``:
        low-rank compression with error feedback. See :mod:`dist_gluon.compression`;
        the codec's state (residuals, Q matrices) is saved by Checkpointer. On one
        process nothing is compressed.
    gradient_predivide_factor : float
        As in Horovod: gradients are divided by this factor before the sum and multiplied
        back after, which keeps fp16 sums in range on many workers.
    prefix : str, optional
        Names this trainer's communication keys (``'<prefix>.<index>'``), so two
        trainers in one program stay apart; a prefix already used in this process is a
        ValueError. By default trainers are numbered in construction order (which must
        be the same on every rank).
    sync_every : int, default 1
        H > 1: Local SGD (:mod:`dist_gluon.local_sgd`). Each worker steps its own
        optimizer on its own gradients, rescaled by its own batch size, with no
        collective; every H steps the parameters are averaged over the workers (their
        deltas since the last synchronisation travel, compressed by ``compression`` if
        given, with a codec of their own). Each worker's optimizer state is its own and
        is kept across a synchronisation. Not on ``dist_async``.
    outer_optimizer : str or mx.optimizer.Optimizer, optional
        DiLoCo: every ``sync_every`` steps this optimizer (any MXNet optimizer; the
        paper's is ``'nag'``) takes the global parameters minus the workers' average as
        its gradient (``rescale_grad`` 1) and updates the global parameters, which every
        worker then continues from. ``'sgd'`` with learning rate 1 is Local SGD.
    outer_optimizer_params : dict, optional
        Its parameters, e.g. ``{'learning_rate': 0.7, 'momentum': 0.9}``.
    local_sgd_warmup : int, default 0
        Post-local SGD: the first this many steps average the gradients every step (as
        with ``sync_every=1``); the rounds of ``sync_every`` steps start after them.
    sync_delay : int, default 0
        Overlap: each synchronisation's sum runs while the workers take this many
        (1 to ``sync_every``) further local steps, after which its update is added to
        their parameters: the global update arrives that many steps late, on top of
        their progress meanwhile (:mod:`dist_gluon.local_sgd`).
    shard_optimizer_states : bool, default False
        ZeRO stage 1 (:mod:`dist_gluon.sharding`, docs/memory.md): each of N workers
        keeps the optimizer state of 1/N of every tensor's rows and updates only those;
        the gradients are summed as without sharding and the new weights reach every
        worker by an allgather (a second sum on ps-lite); the weights are those of the
        unsharded trainer. ``save_states`` and Checkpointer still write the whole
        states in gluon.Trainer's layout. LAMB's trust ratio uses the norms of whole
        tensors (summed over the workers' rows); optimizers that would need more (LARS)
        are refused, and so are ``sync_every`` and ``dg.elastic.State``. Every rank
        still holds the whole summed gradients after ``allreduce_grads()``, so
        ``gluon.utils.clip_global_norm`` works as without sharding. On dist_async the
        servers already hold the optimizer state and nothing changes; on one process
        neither.

    Examples
    --------
    >>> trainer = dg.DistributedTrainer(net.collect_params(), 'sgd',
    ...                                 {'learning_rate': 0.1, 'momentum': 0.9})
    >>> with autograd.record():
    ...     loss = loss_fn(net(data), label)
    >>> loss.backward()
    >>> trainer.step(data.shape[0])      # this worker's batch size, may differ per rank

    With gradient clipping:

    >>> trainer.allreduce_grads()          # every rank: the sum of all gradients
    >>> gluon.utils.clip_global_norm([p.grad() for p in params], max_norm)
    >>> trainer.update(data.shape[0])

    DiLoCo over slow links, 32 local steps between synchronisations:

    >>> trainer = dg.DistributedTrainer(net.collect_params(), 'adam',
    ...                                 {'learning_rate': 1e-3}, sync_every=32,
    ...                                 outer_optimizer='nag',
    ...                                 outer_optimizer_params={'learning_rate': 0.7,
    ...                                                         'momentum': 0.9})
    """

    def __init__(self, params, optimizer, optimizer_params=None, kv=None, compression=None,
                 gradient_predivide_factor: float = 1.0, prefix: str | None = None,
                 sync_every: int = 1, outer_optimizer=None,
                 outer_optimizer_params: dict | None = None, local_sgd_warmup: int = 0,
                 sync_delay: int = 0, shard_optimizer_states: bool = False):
        check_sync_every(sync_every, local_sgd_warmup, outer_optimizer,
                         outer_optimizer_params, sync_delay)
        compression = check_compression(compression)
        predivide = check_predivide(gradient_predivide_factor, compression)
        optimizer = _unwrap_distributed_optimizer(optimizer)
        kv = resolve(kv)
        self._prefix = claim_prefix(prefix, "t", "trainer")
        averager = _GradientAverager(kv, self._prefix, compression, predivide,
                                     owner="DistributedTrainer")
        async_updates.check_options(kv, compression, predivide, "DistributedTrainer",
                                    optimizer)
        self._server_updates = (async_updates.ServerUpdates(kv, "DistributedTrainer")
                                if async_updates.asynchronous(kv) else None)
        super().__init__(params, optimizer, optimizer_params, averager,
                         owner="DistributedTrainer")
        if self._server_updates is not None and len(self._contexts) > 1:
            raise ValueError(
                f"on dist_async the servers update one copy of the weights per worker, but "
                f"the parameters live on {self._contexts}; use one device per worker there "
                "(or dist_sync, which sums a worker's devices first)")
        self._local_sgd = None
        if sync_every > 1 or outer_optimizer is not None:
            if self._server_updates is not None:
                raise ValueError("sync_every and outer_optimizer do not apply on dist_async, "
                                 "whose servers apply every worker's gradient as it arrives; "
                                 "use dist_sync, p3 or horovod for Local SGD and DiLoCo")
            self._local_sgd = LocalSGD(self._kv, self._prefix, sync_every, local_sgd_warmup,
                                       outer_optimizer, outer_optimizer_params, compression,
                                       sync_delay)
        self._shard_requested = bool(shard_optimizer_states)
        self._sharding = self._make_sharding(shard_optimizer_states)
        ParameterSync(self._model_params, self._kv, key=self._averager.key,
                      what="model given to DistributedTrainer").start()

    def _make_sharding(self, shard: bool) -> sharding.OptimizerSharding | None:
        """The sharded optimizer states, when asked for, or a ValueError naming what
        they do not combine with."""
        if not shard:
            return None
        if self._local_sgd is not None:
            raise ValueError("shard_optimizer_states=True and sync_every/outer_optimizer "
                             "(Local SGD, DiLoCo) do not combine: a Local SGD worker steps "
                             "its own optimizer on its own gradients, which needs its "
                             "whole optimizer state; drop one of them")
        sharding.check_optimizer(self._optimizer)
        if self._server_updates is not None:
            return None     # dist_async: the servers hold the optimizer state already
        return sharding.OptimizerSharding(self._kv, self._prefix)

    @property
    def shard_optimizer_states(self) -> bool:
        """Whether the trainer was built with ``shard_optimizer_states=True``."""
        return self._shard_requested

    @property
    def _sharded(self) -> bool:
        """Whether each worker keeps only its part of the optimizer states now (not on
        one process, nor on dist_async, whose servers hold them)."""
        return self._sharding is not None and self._sharding.active

    @property
    def updates_on_servers(self) -> bool:
        return self._server_updates is not None

    @property
    def servers_hold_weights(self) -> bool:
        return self._server_updates is not None and self._server_updates.started

    def step(self, batch_size: float, ignore_stale_grad: bool = False) -> None:
        """Sum the gradients and the batch sizes over the workers, then update every
        parameter with the gradients rescaled by ``1 / (sum of the batch sizes)``.

        Parameters
        ----------
        batch_size : int or float
            The number of samples this worker's gradients were summed over (may differ
            between workers); 1 if the loss was already averaged per worker.
        ignore_stale_grad : bool
            As in ``gluon.Trainer.step``, decided for the whole job: a parameter whose
            gradient is fresh on any rank is updated on every rank with the sum of the
            fresh ranks' gradients (a rank whose backward did not reach it counts zero),
            one stale on every rank is skipped on every rank. Without it, a gradient
            fresh on some ranks only raises
            :class:`~dist_gluon.freshness.StaleGradientError` on every rank.
        """
        if not self._kv_initialized:
            self._init_kvstore()
        if self._params_to_init:
            self._init_params()
        _timeline.begin_step(self._last_grad_written)
        if self._server_updates is not None:
            if amp.overflowed_alone(self):
                # dist_async: each worker's push is its own step; an overflowed one is
                # not pushed (its inf would reach the servers' weights)
                self._step_fresh = None
                _timeline.end_step(batch_size)
                return
            entries = [(i, grad, self._model_params[i].list_data()[0])
                       for i, grad in self._grad_entries()]
            self._step_fresh = None
            self._server_updates.step(*(list(column) for column in zip(*entries)),
                                      scale=self._scale / batch_size, optimizer=self._optimizer,
                                      params=self._model_params, describe=self._describe)
            _timeline.end_step(batch_size)
            return
        samples = batch_size
        if self._local_sgd is not None and self._local_sgd.local:
            self._allreduce_grads()         # this worker's devices only
            self._local_update(batch_size, ignore_stale_grad)
            _timeline.end_step(samples)
            return
        if self._averager.distributed:
            _join.trainer_call(self, "step", ignore_stale_grad)
            self._submit_header(batch_size)
        self._allreduce_grads()
        if self._averager.distributed:
            # the gradients are in flight; only the header (batch sizes, freshness) is
            # waited for
            batch_size = self._read_header()
        self._check_and_rescale_grad(self._scale / batch_size)
        self._update(ignore_stale_grad)
        self._end_step(was_local=False)
        _timeline.end_step(samples)
        self._step_ended()

    def update(self, batch_size: float, ignore_stale_grad: bool = False) -> None:
        """Update every parameter after ``allreduce_grads()``, with the gradients
        rescaled by ``1 / (sum of every worker's batch_size)`` (one small collective).

        Parameters
        ----------
        batch_size : int or float
            As in :meth:`step`: this worker's number of samples.
        ignore_stale_grad : bool
            As in :meth:`step`.
        """
        self._refuse_on_servers("update")
        if self._local_sgd is not None and self._local_sgd.local:
            self._local_update(batch_size, ignore_stale_grad)
            _timeline.end_step(batch_size)      # the step allreduce_grads() began
            return
        samples = batch_size
        if self._averager.distributed:
            _join.trainer_call(self, "update", ignore_stale_grad)
            self._submit_header(batch_size)
            batch_size = self._read_header()
        super().update(batch_size, ignore_stale_grad)
        self._end_step(was_local=False)
        _timeline.end_step(samples)
        self._step_ended()

    def allreduce_grads(self) -> None:
        """Sum the gradients over the workers in place (see :meth:`update`). In a Local
        SGD step (``sync_every``) over this worker's devices only."""
        self._refuse_on_servers("allreduce_grads")
        _timeline.begin_step(self._last_grad_written)
        if self._averager.distributed and not (self._local_sgd and self._local_sgd.local):
            _join.trainer_call(self, "allreduce_grads")
        super().allreduce_grads()

    def extra_state(self) -> tuple[dict[str, mx.nd.NDArray], dict]:
        arrays, counters = super().extra_state()
        if self._local_sgd is not None:
            arrays.update((f"rounds.{name}", a)
                          for name, a in self._local_sgd.state_arrays().items())
            counters["rounds"] = self._local_sgd.state_counters()
        return arrays, counters

    extra_state.__doc__ = TrainerBase.extra_state.__doc__

    def set_extra_counters(self, counters: dict) -> None:
        super().set_extra_counters(counters)
        if self._local_sgd is not None and "rounds" in counters:
            self._local_sgd.set_state_counters(counters["rounds"], self._first_context)

    set_extra_counters.__doc__ = TrainerBase.set_extra_counters.__doc__

    def private_state_names(self) -> set[str]:
        names = super().private_state_names()
        if self._local_sgd is not None:
            names.update(f"rounds.{name}" for name in self._local_sgd.private_state_names())
        return names

    private_state_names.__doc__ = TrainerBase.private_state_names.__doc__

    @property
    def sync_every(self) -> int:
        """Steps between two synchronisations of the parameters (1: every step's
        gradients are averaged)."""
        return 1 if self._local_sgd is None else self._local_sgd.sync_every

    def _local_update(self, batch_size: float, ignore_stale_grad: bool) -> None:
        """A Local SGD step's update: this worker's gradients (its devices' sum) rescaled
        by its own batch size, gluon's stale-gradient semantics; then the round's count,
        and its synchronisation at the H-th step."""
        if not self._kv_initialized:
            self._init_kvstore()
        if self._params_to_init:
            self._init_params()
        self._local_sgd.begin_step(self._model_params)
        self._alone = True
        try:
            self._check_and_rescale_grad(self._scale / batch_size)
            self._update(ignore_stale_grad)
        finally:
            self._alone = False
        self._end_step(was_local=True)
        _syncbn.step_ended()

    def _end_step(self, was_local: bool) -> None:
        if self._local_sgd is not None and not (self._amp_skipped and not was_local):
            self._local_sgd.end_step(self._model_params, was_local)

    def set_learning_rate(self, lr: float) -> None:
        """As ``gluon.Trainer.set_learning_rate``. On ``dist_async`` only before the first
        step: the optimizer then runs on the servers, which a worker's change would not
        reach (a RuntimeError says to use an ``lr_scheduler``, which runs there)."""
        if self._server_updates is not None and self._server_updates.started:
            raise RuntimeError(
                "on dist_async the optimizer runs on the servers since the first step, and "
                "set_learning_rate() on a worker would not reach them; give the optimizer "
                "an lr_scheduler (it runs on the servers, counting every worker's pushes)")
        super().set_learning_rate(lr)

    def sync_weights(self) -> None:
        """On ``dist_async``: wait until every worker's pushes so far are applied on the
        servers, then pull their weights, so that every rank holds the same (before an
        evaluation, for instance). With ``sync_every``: synchronise now if a round is
        under way (the average, or DiLoCo's outer step, of a round cut short; the next
        round has ``sync_every`` steps again). Every rank must call it. Elsewhere every
        rank always holds the same weights and nothing happens."""
        if self._local_sgd is not None:
            self._local_sgd.synchronise(self._model_params)
        if self._server_updates is not None:
            entries = [(i, param.list_data()[0]) for i, param in enumerate(self._model_params)
                       if param.grad_req != "null"]
            self._server_updates.sync_weights([i for i, _ in entries],
                                              [w for _, w in entries])

    def _refuse_on_servers(self, method: str) -> None:
        if self._server_updates is not None:
            raise RuntimeError(
                f"DistributedTrainer.{method}() does not exist on dist_async: the servers "
                "update the weights with each worker's gradient as it arrives, so there is "
                "no summed gradient to work on. Call trainer.step(batch_size); for "
                "clipping, give the optimizer clip_gradient")

    def _allreduce_grads(self):
        if self._local_sgd is not None and self._local_sgd.local:
            self._alone = True
            try:
                self._grad_entries()        # sums the devices, zeroes stale ones there
            finally:
                self._alone = False
            self._spread_grads()
            return
        averager = self._averager
        self._tell_codec_learning_rate()
        entries = self._grad_entries()
        if averager.distributed and self._amp_skips_reduce():
            return      # overflowed on some rank: every rank skips this step
        if not averager.distributed or (averager.codec is not None and averager.codec.batched):
            # 2-bit and PowerSGD pack and pipeline a whole step's tensors; on one process
            # reduce() sends nothing but refuses a gradient the codec cannot take, so
            # that it fails there too, not first on N
            averager.reduce([i for i, _ in entries], [g for _, g in entries],
                            describe=self._describe)
        else:
            for i, grad in entries:
                averager.reduce([i], [grad], describe=self._describe)
        if self._sharded:
            # the first device's updater updates this rank's rows and gathers the
            # weights onto every device
            self._sharding.keep_parts(entries, self._describe)
            return
        self._spread_grads()

    def _update(self, ignore_stale_grad=False):
        # the freshness of every rank is settled by TrainerBase._update first
        updaters = self._updaters
        if self._sharded:
            self._updaters = [_ShardedUpdater(self, u) if k == 0 else _skip_update
                              for k, u in enumerate(updaters)]
        else:
            self._updaters = [_SizeGroupedUpdater(u) for u in updaters]
        try:
            super()._update(ignore_stale_grad)
        finally:
            self._updaters = updaters

    def save_states(self, fname: str) -> None:
        """Save the optimizer states (identical on every rank) from rank 0 only, indexed
        as gluon.Trainer indexes them (``gluon.Trainer.load_states`` reads the file);
        every rank returns once the file is written. With ``shard_optimizer_states``
        the ranks' parts are gathered first: the file holds the whole states, and
        every rank must call it."""
        blob = self.whole_states_file()
        if self._kv.rank == 0:
            if blob is None:
                super().save_states(fname)
            else:
                with open(fname, "wb") as f:
                    f.write(blob)
        self._kv.barrier()

    def whole_states_file(self) -> bytes | None:
        """With ``shard_optimizer_states``: the bytes of the states file of the whole
        optimizer states, gathered from every rank's parts (a collective: every rank
        calls it). None without sharding, where ``gluon.Trainer.save_states`` writes
        the file from any rank's states."""
        if not self._sharded:
            return None
        if not self._kv_initialized:
            self._init_kvstore()
        if self._params_to_init:
            self._init_params()
        return self._sharding.state_file(self._updaters[0], self._optimizer, self._params,
                                         self.optimizer_positions())

    def _states_loaded(self) -> None:
        # after whole states were loaded: keep this rank's part of them
        if self._sharded:
            self._sharding.keep_own_states(self._updaters, self._params,
                                           self.optimizer_positions())

    def _optimizer_states(self) -> dict[int, list]:
        # with sharding each rank holds other parts: the sync check compares weights only
        return {} if self._sharded else super()._optimizer_states()

    def load_states(self, fname: str) -> None:
        """Load optimizer states from ``fname`` as read by rank 0, so only rank 0 needs
        to see the file; every rank ends with the same states. The file may come from
        ``gluon.Trainer.save_states`` of the same parameters (or horovod.mxnet's or
        BytePS's trainer): the indices are gluon.Trainer's."""
        self._load_rank0_states(fname)


class _SizeGroupedUpdater:
    """Calls an ``mx.optimizer.Updater`` with large tensors one at a time and the small
    ones together, sorted by size.

    gluon.Trainer passes every tensor in parameter order, and the updater aggregates
    MXNET_OPTIMIZER_AGGREGATION_SIZE (4) consecutive tensors per fused kernel
    (multi_sgd_mom_update...), which loops over the largest tensor of the group for all
    of them. In model order a group is a large conv weight with small BatchNorm
    tensors, or two large Dense weights; both run far slower than separate calls
    (ResNet-18 update 44 -> 26 ms, 100M-parameter MLP 413 -> 217 ms, one thread).
    Indices are unchanged, so optimizer states and lr/wd multipliers are too."""

    def __init__(self, updater):
        self._updater = updater

    def __call__(self, indices, grads, weights):
        small, large = [], []
        for entry in zip(indices, grads, weights):
            (large if entry[2].size > _AGGREGATE_BELOW else small).append(entry)
        for index, grad, weight in large:
            self._updater([index], [grad], [weight])
        if small:
            small.sort(key=lambda entry: entry[2].size)
            self._updater(*(list(column) for column in zip(*small)))


class _ShardedUpdater:
    """The first device's updater with ``shard_optimizer_states``: gluon's update calls
    it with every parameter to update; it updates this rank's part of each and gathers
    the whole weights onto every device (dist_gluon.sharding)."""

    def __init__(self, trainer: DistributedTrainer, updater):
        self._trainer = trainer
        self._updater = updater

    def __call__(self, indices, grads, weights):
        trainer = self._trainer
        trainer._sharding.update(self._updater, indices, weights,
                                 trainer.optimizer_positions(), trainer._params,
                                 apply=_SizeGroupedUpdater(self._updater))


def _skip_update(indices, grads, weights):
    """Another device's updater with ``shard_optimizer_states``: the first device's
    gathers the weights onto every device."""


def _unwrap_distributed_optimizer(optimizer):
    inner = getattr(optimizer, "_dg_wrapped_optimizer", None)
    if inner is None:
        return optimizer
    warnings.warn("DistributedTrainer was given a DistributedOptimizer; it averages "
                  "gradients itself, so the wrapped optimizer is used directly",
                  stacklevel=3)
    return inner

