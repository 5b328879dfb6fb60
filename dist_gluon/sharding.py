"""The optimizer state sharded over the workers (ZeRO stage 1):
``DistributedTrainer(..., shard_optimizer_states=True)``.

Every tensor is split into ``num_workers`` consecutive parts of its flattened elements
(:func:`~dist_gluon.backends.base.shard_bounds`: the first ``size % N`` ranks hold one
element more), so each worker holds the optimizer state of 1/N of every tensor: balanced
by size to within one element per tensor, the same on every run and every rank, and a
large tensor is spread over every worker. A step is:

1. the gradients' reduce-scatter: each rank receives the sum over the workers of its
   part of each gradient (the backend's ``reducescatter``; horovod's
   ``grouped_reducescatter``), in groups of at most :data:`_GROUP_ELEMENTS` elements;
   with compression or ``gradient_predivide_factor`` the codec sums the whole gradient
   as without sharding (its residuals stay per worker) and each rank keeps its part;
2. the update of the rank's part of each weight, by the trainer's own updater, whose
   states therefore have the shape of the parts (gluon's optimizer indices, lr_mult,
   wd_mult, update counts and schedules are unchanged: it is the same update, element
   by element);
3. the allgather of the updated parts: every rank ends with the whole new weights.

Only optimizers whose update of an element reads nothing but that element's weight,
gradient and state are accepted (:data:`ELEMENTWISE`): LAMB, LARS and LBSGD scale a
tensor's update by norms of the whole tensor, and are refused at construction rather
than computed from a part. ``save_states`` and :class:`~dist_gluon.Checkpointer` gather
the whole states into gluon.Trainer's layout; a file loads on any number of workers,
sharded or not, and each rank keeps its part.
"""
from __future__ import annotations

import copy
import functools
import pickle

import mxnet as mx
import numpy as np

from .backends.base import shard_bounds
from .broadcast import optimizer_state_arrays

# The optimizers whose update is element by element, so that updating a part of a
# tensor with its part of the state is the update of the whole tensor restricted to it.
ELEMENTWISE = (mx.optimizer.SGD, mx.optimizer.NAG, mx.optimizer.Signum, mx.optimizer.FTML,
               mx.optimizer.DCASGD, mx.optimizer.Adam, mx.optimizer.AdaGrad,
               mx.optimizer.RMSProp, mx.optimizer.AdaDelta, mx.optimizer.Ftrl,
               mx.optimizer.Adamax, mx.optimizer.Nadam)
# Why the others cannot run on a part of a tensor.
_WHY_NOT = {
    "LAMB": "its per-layer trust ratio divides the norm of each whole weight by the "
            "norm of its whole update",
    "LARS": "its layer-wise rate divides the norm of each whole weight by the norm of "
            "its whole gradient",
    "LBSGD": "its LARS warm-up scales each tensor by norms of the whole tensor",
    "SGLD": "its noise is drawn per tensor, so parts would not draw one process's noise",
}
# Elements per grouped collective: a group's outputs all exist until it is waited for,
# so this bounds the transient memory of a step (64 MiB of float32, horovod's default
# fusion buffer).
_GROUP_ELEMENTS = 1 << 24


def check_optimizer(optimizer: mx.optimizer.Optimizer) -> None:
    """Refuse an optimizer whose update needs whole tensors (a ValueError naming it)."""
    if type(optimizer) in ELEMENTWISE:
        return
    name = type(optimizer).__name__
    why = _WHY_NOT.get(name, "dist_gluon does not know that its update is element by "
                             "element (only MXNet's own optimizers are checked)")
    accepted = ", ".join(sorted(cls.__name__ for cls in ELEMENTWISE))
    raise ValueError(
        f"shard_optimizer_states=True updates each worker's part of every tensor, and "
        f"the optimizer {name} cannot run on a part: {why}. Use shard_optimizer_states="
        f"False with {name}, or one of {accepted}")


class OptimizerSharding:
    """Each worker's part of the gradients, updates and optimizer states.

    Parameters
    ----------
    kv : Backend
        Its ``reducescatter`` and ``allgather`` carry the gradients and weights.
    prefix : str
        The trainer's key prefix.
    """

    def __init__(self, kv, prefix: str):
        self.kv = kv
        self.prefix = prefix
        # this step's part of each summed gradient, by model position, from the reduce
        # until the update that consumes it
        self._parts: dict[int, mx.nd.NDArray] = {}

    @property
    def active(self) -> bool:
        """Whether there is anything to shard (one process holds every part)."""
        return self.kv.num_workers > 1

    def bounds(self, size: int) -> tuple[int, int]:
        """This rank's elements ``[start, stop)`` of a flattened tensor of ``size``."""
        return shard_bounds(size, self.kv.num_workers, self.kv.rank)

    # ------------------------------------------------------------ gradients
    def reduce_scatter(self, entries: list[tuple[int, mx.nd.NDArray]], describe) -> None:
        """Sum the gradients ``entries`` ((model position, gradient), the same on every
        rank) over the workers, keeping this rank's part of each sum."""
        self._check_dense(entries, describe)
        for group in _groups(entries, lambda entry: entry[1]):
            positions = [position for position, _ in group]
            parts = self.kv.reducescatter([f"{self.prefix}.rs.{p}" for p in positions],
                                          [grad.reshape((-1,)) for _, grad in group],
                                          priority=-positions[0])
            self._parts.update(zip(positions, parts))

    def keep_parts(self, entries: list[tuple[int, mx.nd.NDArray]], describe) -> None:
        """Keep this rank's part of gradients already summed whole (by a codec)."""
        self._check_dense(entries, describe)
        for position, grad in entries:
            self._parts[position] = self._part(grad)

    def _part(self, array: mx.nd.NDArray) -> mx.nd.NDArray:
        """A copy of this rank's part of ``array``, flattened (made by operators, so an
        array in MKLDNN's layout is read correctly)."""
        start, stop = self.bounds(array.size)
        if stop == start:
            return mx.nd.empty((0,), ctx=array.context, dtype=array.dtype)
        return mx.nd.slice(mx.nd.reshape(array, shape=(-1,)), begin=(start,), end=(stop,))

    @staticmethod
    def _check_dense(entries, describe) -> None:
        for position, grad in entries:
            if grad.stype != "default":
                raise TypeError(f"shard_optimizer_states=True shards dense gradients; "
                                f"{describe(position)} has a {grad.stype} gradient (use "
                                "sparse_grad=False, or shard_optimizer_states=False)")

    def global_norm(self) -> mx.nd.NDArray:
        """The 2-norm of this step's whole summed gradients, from every rank's parts
        (one scalar sum over the workers), as a (1,) float32 array."""
        squares = [mx.nd.sum(mx.nd.square(part.astype("float32")))
                   for part in self._parts.values() if part.size]
        total = mx.nd.add_n(*squares) if squares else mx.nd.zeros((1,))
        total = total.reshape((1,))
        self.kv.pushpull(f"{self.prefix}.norm", total)
        return mx.nd.sqrt(total)

    def scale_parts(self, factor: float) -> None:
        """Multiply this step's gradient parts by ``factor`` (clipping)."""
        for part in self._parts.values():
            if part.size:       # MXNet 1.x takes a (0,) shape for an unknown one
                part *= factor

    @property
    def has_parts(self) -> bool:
        return bool(self._parts)

    # ------------------------------------------------------------ update
    def update(self, updater, indices, weights, positions: list, params: list) -> None:
        """Update this rank's part of the weights of optimizer ``indices`` (their arrays
        on the first device, ``weights``) with its part of the summed gradients, then
        gather the whole new weights into every device of ``params`` (the trainer's,
        in optimizer order). Every rank calls it with the same indices."""
        missing = [i for i in indices if positions[i] not in self._parts]
        if missing:
            self._parts.clear()
            raise RuntimeError(
                "with shard_optimizer_states=True, update() applies the gradients that "
                "allreduce_grads() summed: call trainer.allreduce_grads() before "
                "trainer.update(batch_size) in every step (or call trainer.step)")
        entries = []
        for index, weight in zip(indices, weights):
            part = self._parts.pop(positions[index])
            entries.append((index, part, self._part(weight)))
        self._parts.clear()
        mine = [entry for entry in entries if entry[1].size]
        if mine:
            updater(*(list(column) for column in zip(*mine)))
        for group in _groups(entries, lambda entry: params[entry[0]].list_data()[0]):
            wholes = self.kv.allgather([f"{self.prefix}.ag.{positions[i]}" for i, _, _ in group],
                                       [w for _, _, w in group],
                                       [params[i].list_data()[0].size for i, _, _ in group],
                                       priority=-positions[group[0][0]])
            for (index, _, _), whole in zip(group, wholes):
                for data in params[index].list_data():
                    whole.reshape(data.shape).copyto(data)

    # ------------------------------------------------------------ states
    def gather_states(self, updater, params: list) -> dict:
        """The whole optimizer states (gluon.Trainer's layout: optimizer index ->
        state of the whole tensor) from every rank's parts; a collective. Rank 0 holds
        a part of every tensor, so its states say which exist and their structure."""
        layout = {index: _layout(state) for index, state in updater.states.items()}
        if self.kv.num_workers > 1:
            layout = self.kv.broadcast_object(layout)
        whole: dict = {}
        for index in sorted(layout):
            size = params[index].list_data()[0].size
            start, stop = self.bounds(size)
            state = updater.states.get(index)
            if state is None or stop == start:
                state = _rebuild(layout[index], functools.partial(
                    _empty, ctx=params[index].list_ctx()[0]))
            leaves = optimizer_state_arrays(state)
            for leaf in leaves:
                if leaf.size != stop - start:
                    raise RuntimeError(f"optimizer state {index} holds {leaf.size} elements "
                                       f"on rank {self.kv.rank}, its part has {stop - start}")
            gathered = self.kv.allgather([f"{self.prefix}.st.{index}.{k}"
                                          for k in range(len(leaves))],
                                         [leaf.reshape((-1,)) for leaf in leaves],
                                         [size] * len(leaves))
            shaped = iter([g.reshape(params[index].shape) for g in gathered])
            whole[index] = _rebuild(layout[index], lambda _, arrays=shaped: next(arrays))
        return whole

    def merged_counts(self, optimizer: mx.optimizer.Optimizer) -> dict:
        """Every rank's update counts merged (a rank counts only the tensors it holds
        a part of): index -> count, as one process's optimizer holds them."""
        counts = [dict(optimizer._index_update_count)]
        if self.kv.num_workers > 1:
            counts = self.kv.allgather_object(counts[0])
        merged: dict = {}
        for mine in counts:
            for index, count in mine.items():
                merged[index] = max(count, merged.get(index, count))
        return merged

    def state_file(self, updater, optimizer, params: list) -> bytes:
        """The bytes of ``gluon.Trainer.save_states``'s file of the whole states; a
        collective (every rank gets them)."""
        states = self.gather_states(updater, params)
        whole = copy.copy(optimizer)
        whole._index_update_count = self.merged_counts(optimizer)
        whole.num_update = max(whole._index_update_count.values(),
                               default=optimizer.num_update)
        return pickle.dumps((states, whole), protocol=4)

    def keep_own_states(self, updaters: list, params: list) -> None:
        """After whole states were loaded into ``updaters`` (gluon's, one per device):
        keep this rank's part of each, on the first device's updater only."""
        first = updaters[0]
        mine = {}
        for index, state in first.states.items():
            size = int(np.prod(params[index].shape))
            start, stop = self.bounds(size)
            if stop == start:
                continue
            mine[index] = _map_leaves(state, functools.partial(
                self._part_of_whole, size=size, start=start, stop=stop, index=index))
        first.states = mine
        first.states_synced = dict.fromkeys(mine, False)
        for other in updaters[1:]:
            other.states, other.states_synced = {}, {}

    def _part_of_whole(self, leaf, size, start, stop, index):
        if leaf.size == stop - start and leaf.size != size:
            return leaf.reshape((-1,))     # a part already
        if leaf.size != size:
            raise ValueError(f"optimizer state {index} holds {leaf.size} elements, but its "
                             f"parameter has {size}")
        return self._part(leaf)


def _groups(entries: list, array_of) -> list[list]:
    """``entries`` cut into consecutive groups of one dtype and at most
    :data:`_GROUP_ELEMENTS` elements (a larger tensor alone); the same on every rank."""
    groups, current, count, dtype = [], [], 0, None
    for entry in entries:
        array = array_of(entry)
        if current and (np.dtype(array.dtype) != dtype
                        or count + array.size > _GROUP_ELEMENTS):
            groups.append(current)
            current, count = [], 0
        current.append(entry)
        count += array.size
        dtype = np.dtype(array.dtype)
    if current:
        groups.append(current)
    return groups


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


def _empty(dtype, ctx):
    return mx.nd.empty((0,), ctx=ctx, dtype=dtype)


def _map_leaves(state, fn):
    if isinstance(state, mx.nd.NDArray):
        return fn(state)
    if isinstance(state, (tuple, list)):
        return type(state)(_map_leaves(part, fn) for part in state)
    return state
