"""The optimizer state sharded over the workers (ZeRO stage 1):
``DistributedTrainer(..., shard_optimizer_states=True)``.

Every tensor is split along its first axis into ``num_workers`` consecutive parts
(:func:`~dist_gluon.backends.base.shard_counts`): ``rows // N`` rows each, and one more
for ``rows % N`` ranks, which start at rank ``position % N`` for the tensor at model
``position`` so that no rank collects every tensor's extra row. Each worker holds the
optimizer state of its rows of every tensor: about 1/N of the elements, balanced to
within a row per tensor, the same on every run and rank, and a large tensor is spread
over every worker (a tensor with fewer rows than workers is held whole by few of
them). A step is:

1. the gradients' sum over the workers, as without sharding (the same allreduce per
   tensor as its gradient is ready, with its priority, its codec and the residuals of
   each worker's own): horovod 0.28.1's ``grouped_reducescatter`` moves half the bytes
   but took 2.4x (2 ranks) to 8x (4 ranks) as long as an allreduce of the same 64 MiB
   over Gloo on a 2-core host (measured by hand: 130 ms against 55 ms, 0.9 s against
   0.12 s), and waits until all its tensors are ready, so the backend's
   ``reducescatter`` is not on this path;
2. the update of this rank's rows of each weight by the trainer's own updater, whose
   states have the shape of those rows (gluon's optimizer indices, ``lr_mult``,
   ``wd_mult``, update counts and schedules are unchanged: it is the same update,
   element by element, as the unsharded trainer's);
3. the allgather of the updated rows into the weights themselves (the backend's
   ``allgather`` with ``out=``: horovod's, asynchronous on MXNet's engine; elsewhere a
   sum of weights that are zeros but for each rank's rows, exact).

Optimizers whose update of an element reads nothing but that element's weight,
gradient and state are accepted (:data:`ELEMENTWISE`), and LAMB, whose per-layer trust
ratio needs the norms of each whole tensor: they are summed over the ranks' rows
(one small sum a step). LARS and LBSGD, which scale by norms too, are refused at
construction rather than computed from a part, and so is any optimizer dist_gluon
does not know. ``save_states`` and :class:`~dist_gluon.Checkpointer` gather
the whole states into gluon.Trainer's layout; a file loads on any number of workers,
sharded or not, and each rank keeps its rows.
"""
from __future__ import annotations

import copy
import functools
import pickle

import mxnet as mx
import numpy as np

from . import timeline as _timeline
from .backends.base import shard_counts
from .broadcast import optimizer_state_arrays

# The optimizers whose update is element by element, so that updating a part of a
# tensor with its part of the state is the update of the whole tensor restricted to it.
ELEMENTWISE = (mx.optimizer.SGD, mx.optimizer.NAG, mx.optimizer.Signum, mx.optimizer.FTML,
               mx.optimizer.DCASGD, mx.optimizer.Adam, mx.optimizer.AdaGrad,
               mx.optimizer.RMSProp, mx.optimizer.AdaDelta, mx.optimizer.Ftrl,
               mx.optimizer.Adamax, mx.optimizer.Nadam)
# Updated here by parts, with each tensor's norms summed over the ranks' parts
# (OptimizerSharding._lamb_update): the trust ratio of the whole tensor, exactly.
WHOLE_TENSOR_NORMS = (mx.optimizer.LAMB,)
# Why the others cannot run on a part of a tensor.
_WHY_NOT = {
    "LARS": "its layer-wise rate divides the norm of each whole weight by the norm of "
            "its whole gradient",
    "LBSGD": "its LARS warm-up scales each tensor by norms of the whole tensor",
    "SGLD": "its noise is drawn per tensor, so parts would not draw one process's noise",
}


def check_optimizer(optimizer: mx.optimizer.Optimizer) -> None:
    """Refuse an optimizer whose update needs whole tensors (a ValueError naming it)."""
    if type(optimizer) in ELEMENTWISE + WHOLE_TENSOR_NORMS:
        return
    name = type(optimizer).__name__
    why = _WHY_NOT.get(name, "dist_gluon does not know that its update is element by "
                             "element (only MXNet's own optimizers are checked)")
    accepted = ", ".join(sorted(cls.__name__ for cls in ELEMENTWISE + WHOLE_TENSOR_NORMS))
    raise ValueError(
        f"shard_optimizer_states=True updates each worker's part of every tensor, and "
        f"the optimizer {name} cannot run on a part: {why}. Use shard_optimizer_states="
        f"False with {name}, or one of {accepted}")


class OptimizerSharding:
    """Each worker's rows of the gradients, updates and optimizer states.

    Parameters
    ----------
    kv : Backend
        Its ``allgather`` carries the updated weights.
    prefix : str
        The trainer's key prefix.
    """

    def __init__(self, kv, prefix: str):
        self.kv = kv
        self.prefix = prefix
        # this step's rows of each summed gradient (views), by model position, from the
        # sum until the update that consumes them
        self._parts: dict[int, mx.nd.NDArray] = {}
        self._summed = False
        # this rank's rows of each weight, read before the update and updated there:
        # kept from step to step (1/N of the weights' bytes), since a fresh array each
        # step stays in the allocator's heap as much and fragments it
        self._weight_rows: dict[int, mx.nd.NDArray] = {}

    @property
    def active(self) -> bool:
        """Whether there is anything to shard (one process holds every part)."""
        return self.kv.num_workers > 1

    def counts(self, position: int, shape) -> list[int]:
        """Every rank's number of rows of the tensor of ``shape`` at model ``position``."""
        return shard_counts(shape[0], self.kv.num_workers, position % self.kv.num_workers)

    def bounds(self, position: int, shape) -> tuple[int, int]:
        """This rank's rows ``[start, stop)`` of the tensor at model ``position``."""
        counts = self.counts(position, shape)
        start = sum(counts[:self.kv.rank])
        return start, start + counts[self.kv.rank]

    # ------------------------------------------------------------ gradients
    def keep_parts(self, entries: list[tuple[int, mx.nd.NDArray]], describe) -> None:
        """Keep this rank's rows of the summed gradients ``entries`` ((model position,
        gradient), summed whole in place): views, nothing is copied."""
        self._summed = True
        for position, grad in entries:
            if grad.stype != "default":
                raise TypeError(f"shard_optimizer_states=True shards dense gradients; "
                                f"{describe(position)} has a {grad.stype} gradient (use "
                                "sparse_grad=False, or shard_optimizer_states=False)")
            start, stop = self.bounds(position, grad.shape)
            if stop > start:
                self._parts[position] = grad[start:stop]

    # ------------------------------------------------------------ update
    def update(self, updater, indices, weights, positions: list, params: list,
               apply=None) -> None:
        """Update this rank's rows of the weights of optimizer ``indices`` (their arrays
        on the first device, ``weights``) with its rows of the summed gradients, then
        give every device of ``params`` (the trainer's, in optimizer order) the whole
        new weights. Every rank calls it with the same indices. ``updater`` is the
        trainer's ``mx.optimizer.Updater`` (its states are this rank's rows);
        ``apply(indices, grads, weights)`` calls it (by default, directly)."""
        summed, self._summed = self._summed, False
        if indices and not summed:
            raise RuntimeError(
                "with shard_optimizer_states=True, update() applies the gradients that "
                "allreduce_grads() summed: call trainer.allreduce_grads() before "
                "trainer.update(batch_size) in every step (or call trainer.step)")
        rows, mine = [], []
        for index, weight in zip(indices, weights):
            start, stop = self.bounds(positions[index], weight.shape)
            part = None
            if stop > start:
                # an operator's copy, not a view: a view of a weight held in MKLDNN's
                # layout (a hybridized CPU model's after an inference forward) is read
                # correctly but written wrongly
                part = self._rows_buffer(positions[index], weight, stop - start)
                mx.nd.slice_axis(weight, axis=0, begin=start, end=stop, out=part)
                mine.append((index, self._parts[positions[index]], part))
            rows.append((index, weight, part))
        self._parts.clear()
        opt = updater.optimizer
        if weights:
            opt._set_current_context(weights[0].context.device_id)
        if isinstance(opt, WHOLE_TENSOR_NORMS):
            self._lamb_update(updater, [index for index, *_ in rows], mine)
        else:
            # the tensors this rank holds no rows of are counted too: every rank's
            # update counts (the schedule's num_update) stay those of one process
            held = {index for index, *_ in mine}
            opt._update_count([index for index, *_ in rows if index not in held])
            if mine:
                (apply or updater)(*(list(column) for column in zip(*mine)))
        self._gather(rows, positions, params)

    def _gather(self, rows: list, positions: list, params: list) -> None:
        """Every device of each tensor of ``rows`` gets the whole new weights."""
        for index, weight, part in rows:
            self._gather_into(weight, part, positions[index])
            for data in params[index].list_data()[1:]:
                weight.copyto(data)

    def _lamb_update(self, updater, indices: list, mine: list) -> None:
        """LAMB on this rank's rows, with the trust ratio of each whole tensor: phase 1
        (the Adam-like step, element by element) on the rows, each tensor's squared
        norms of weight and step summed over the ranks' rows (one small sum for every
        tensor), then phase 2 with the whole tensors' norms. ``indices``: every
        optimizer index updated this step (the same on every rank), ``mine``: (index,
        gradient rows, weight rows) of those this rank holds rows of."""
        opt = updater.optimizer
        opt._update_count(indices)      # every rank counts every tensor, as one process
        squares = mx.nd.zeros((2 * len(indices),), dtype="float32")
        slot = {index: k for k, index in enumerate(indices)}
        steps = []
        for index, grad, weight in mine:
            if index not in updater.states:
                updater.states[index] = opt.create_state_multi_precision(index, weight)
                updater.states_synced[index] = True
            elif not updater.states_synced[index]:
                updater.states[index] = updater.sync_state_context(updater.states[index],
                                                                   weight.context)
                updater.states_synced[index] = True
            state = updater.states[index]
            master = opt.multi_precision and weight.dtype == np.float16
            mean, var = state[1] if master else state
            kwargs = {"beta1": opt.beta1, "beta2": opt.beta2, "epsilon": opt.epsilon,
                      "bias_correction": opt.bias_correction, "rescale_grad": opt.rescale_grad,
                      "t": opt._index_update_count[index], "wd": opt._get_wd(index)}
            if opt.clip_gradient:
                kwargs["clip_gradient"] = opt.clip_gradient
            if master:
                step = mx.nd.mp_lamb_update_phase1(weight, grad, mean, var, state[0], **kwargs)
            else:
                step = mx.nd.lamb_update_phase1(weight, grad, mean, var, **kwargs)
            full = state[0] if master else weight
            k = slot[index]
            squares[2 * k:2 * k + 1] = mx.nd.sum(mx.nd.square(full.astype("float32")))
            squares[2 * k + 1:2 * k + 2] = mx.nd.sum(mx.nd.square(step.astype("float32")))
            steps.append((index, weight, step, master, state))
        self.kv.pushpull(f"{self.prefix}.lamb_norms", squares)
        norms = mx.nd.sqrt(squares)
        bounds = {name: getattr(opt, name) for name in ("lower_bound", "upper_bound")
                  if getattr(opt, name)}
        for index, weight, step, master, state in steps:
            k = slot[index]
            r1, r2 = norms[2 * k:2 * k + 1], norms[2 * k + 1:2 * k + 2]
            if master:
                mx.nd.mp_lamb_update_phase2(weight, step, r1, r2, state[0],
                                            lr=opt._get_lr(index), out=weight, **bounds)
            else:
                mx.nd.lamb_update_phase2(weight, step, r1, r2, lr=opt._get_lr(index),
                                         out=weight, **bounds)

    def _rows_buffer(self, position: int, weight, rows: int) -> mx.nd.NDArray:
        buffer = self._weight_rows.get(position)
        shape = (rows,) + tuple(weight.shape[1:])
        if buffer is None or buffer.shape != shape or buffer.dtype != weight.dtype:
            buffer = mx.nd.empty(shape, ctx=weight.context, dtype=weight.dtype)
            self._weight_rows[position] = buffer
        return buffer

    def _gather_into(self, weight, part, position: int) -> None:
        """Write every rank's updated rows into ``weight``: the backend's allgather
        into the weight itself (horovod's runs on the engine, in priority order, and
        the next forward waits only for the weights it reads; ps-lite sums weights
        that are zeros but for each rank's rows)."""
        if part is None:
            part = mx.nd.empty((0,) + weight.shape[1:], ctx=weight.context,
                               dtype=weight.dtype)
        # the gradient's own key: ps-lite keeps a copy per key on the servers and a
        # buffer per slice on the workers, which a key of its own would double
        key = f"{self.prefix}.{position}"
        self.kv.allgather(key, part, self.counts(position, weight.shape), out=weight,
                          priority=-position)
        _timeline.collective(key, weight, _nbytes([weight]), "allgather")

    # ------------------------------------------------------------ states
    def gather_states(self, updater, params: list, positions: list) -> dict:
        """The whole optimizer states (gluon.Trainer's layout: optimizer index ->
        state of the whole tensor) from every rank's rows; a collective. Which states
        exist and their structure come from the ranks that hold rows of each tensor."""
        mine = {index: _layout(state) for index, state in updater.states.items()}
        layout: dict = {}
        for each in (self.kv.allgather_object(mine) if self.kv.num_workers > 1 else [mine]):
            for index, structure in each.items():
                layout.setdefault(index, structure)
        whole: dict = {}
        for index in sorted(layout):
            shape, position = params[index].shape, positions[index]
            start, stop = self.bounds(position, shape)
            state = updater.states.get(index)
            if state is None and stop > start:
                raise RuntimeError(f"rank {self.kv.rank} holds rows of optimizer index "
                                   f"{index} but no state for them, while other ranks do")
            if stop == start:
                state = _rebuild(layout[index], functools.partial(
                    _no_rows, shape=shape, ctx=params[index].list_ctx()[0]))
            leaves = optimizer_state_arrays(state)
            gathered = self.kv.allgather([f"{self.prefix}.st.{index}.{k}"
                                          for k in range(len(leaves))], leaves,
                                         [self.counts(position, shape)] * len(leaves))
            arrays = iter(gathered)
            whole[index] = _rebuild(layout[index], lambda _, arrays=arrays: next(arrays))
        return whole

    def merged_counts(self, optimizer: mx.optimizer.Optimizer) -> dict:
        """Every rank's update counts merged (a rank counts only the tensors it holds
        rows of): index -> count, as one process's optimizer holds them."""
        counts = [dict(optimizer._index_update_count)]
        if self.kv.num_workers > 1:
            counts = self.kv.allgather_object(counts[0])
        merged: dict = {}
        for mine in counts:
            for index, count in mine.items():
                merged[index] = max(count, merged.get(index, count))
        return merged

    def state_file(self, updater, optimizer, params: list, positions: list) -> bytes:
        """The bytes of ``gluon.Trainer.save_states``'s file of the whole states; a
        collective (every rank gets them)."""
        states = self.gather_states(updater, params, positions)
        whole = copy.copy(optimizer)
        merged = self.merged_counts(optimizer)
        # the updater switches _index_update_count to its device's table of these
        device = next((d for d, table in optimizer._all_index_update_counts.items()
                       if table is optimizer._index_update_count), 0)
        whole._all_index_update_counts = {device: merged}
        whole._index_update_count = merged
        whole.num_update = max(merged.values(), default=optimizer.num_update)
        return pickle.dumps((states, whole), protocol=4)

    def keep_own_states(self, updaters: list, params: list, positions: list) -> None:
        """After whole states were loaded into ``updaters`` (gluon's, one per device):
        keep this rank's rows of each, on the first device's updater only."""
        first = updaters[0]
        mine = {}
        for index, state in first.states.items():
            shape = params[index].shape
            start, stop = self.bounds(positions[index], shape)
            if stop > start:
                mine[index] = _map_leaves(state, functools.partial(
                    _rows_of, shape=shape, start=start, stop=stop, index=index))
        first.states = mine
        first.states_synced = dict.fromkeys(mine, False)
        for other in updaters[1:]:
            other.states, other.states_synced = {}, {}


def _rows_of(leaf, shape, start, stop, index):
    if tuple(leaf.shape) != tuple(shape):
        raise ValueError(f"optimizer state {index} has shape {leaf.shape}, but its "
                         f"parameter has {shape}")
    return mx.nd.slice_axis(leaf, axis=0, begin=start, end=stop)


def _nbytes(arrays) -> int:
    return sum(a.size * np.dtype(a.dtype).itemsize for a in arrays)


def _layout(state):
    """A state's structure with its arrays' dtypes in place of the arrays."""
    if isinstance(state, mx.nd.NDArray):
        return np.dtype(state.dtype).name
    if isinstance(state, (tuple, list)):
        return type(state)(_layout(part) for part in state)
    return None


def _rebuild(layout, make):
    """``layout`` with each dtype replaced by ``make(dtype)``."""
    if isinstance(layout, str):
        return make(layout)
    if isinstance(layout, (tuple, list)):
        return type(layout)(_rebuild(part, make) for part in layout)
    return None


def _no_rows(dtype, shape, ctx):
    return mx.nd.empty((0,) + tuple(shape[1:]), ctx=ctx, dtype=dtype)


def _map_leaves(state, fn):
    if isinstance(state, mx.nd.NDArray):
        return fn(state)
    if isinstance(state, (tuple, list)):
        return type(state)(_map_leaves(part, fn) for part in state)
    return state
