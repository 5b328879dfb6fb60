"""What a worker keeps through a fault: :class:`State`, horovod elastic's shape.

The weights, the optimizer's states and counters, and the script's own values (epoch,
position in the epoch, ...) are copied in memory at every :meth:`State.commit`, on
MXNet's engine, into arrays allocated once: nothing leaves the engine (no copy to
NumPy). Two sets of copies take turns: a commit writes one set while the other holds
the last good commit, and becomes the good one once its copies are known to be clean:
a failed collective stores its failure on the arrays it wrote and on everything
computed from them (the updated weights, and so the copies), and MXNet throws it once,
at the first wait on any of them, then clears it everywhere. So each commit waits for
its own copies (the end of its step), and a commit whose step failed is never restored.
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import mxnet as mx
from mxnet.base import MXNetError

from ..backends import Backend, resolve
from ..broadcast import optimizer_state_arrays, parameter_list, set_update_counters, update_counters
from . import stop

_KEY = "__dg_elastic"
# how many times an array is waited for to throw (and so clear) the failures MXNet
# stored on it: one per failed operation that wrote it, in practice one or two
_CLEAR_TRIES = 8


class HostsUpdatedInterrupt(RuntimeError):
    """Raised by :meth:`State.commit` on every rank at the same commit when the
    launcher re-forms the job (a node joins or leaves at a step boundary);
    :func:`dist_gluon.elastic.run` catches it and enters the training function again on
    the new world, from this very commit."""


def clear_failures(arrays) -> None:
    """Throw away the failures MXNet's engine stored on ``arrays`` (a failed
    collective's outputs, and what was computed from them): an exception stored on an
    array is thrown once, at the next wait, and then cleared; an array written later
    keeps a stored failure until then. Also the failures the engine keeps for
    ``waitall``."""
    for arr in arrays:
        for _ in range(_CLEAR_TRIES):
            try:
                arr.wait_to_read()
                break
            except MXNetError:
                continue
    for _ in range(_CLEAR_TRIES):
        try:
            mx.nd.waitall()
            break
        except MXNetError:
            continue


class _Snapshot:
    """One set of copies: arrays by key, the optimizer's counters, the extras."""

    def __init__(self):
        self.arrays: dict[tuple, mx.nd.NDArray] = {}
        self.counters: dict | None = None
        self.extras: dict[str, Any] = {}
        self.serial: int | None = None  # which state of the job (State._serial)
        self.slot: int | None = None    # the node copy's slot its arrays live in, if any



def _freshest(serials: list[int | None]) -> int:
    """The lowest rank that holds the newest commit (rank 0 when none holds any)."""
    known = [s for s in serials if s is not None]
    return serials.index(max(known)) if known else 0


def _key_difference(mine: list, theirs: list) -> str:
    """What a rank's kept arrays lack and add beside the root's, for an error."""
    mine = [list(k) for k in mine]
    lacks = [k for k in theirs if k not in mine]
    adds = [k for k in mine if k not in theirs]
    if not lacks and not adds:
        return f"the same {len(mine)} arrays in another order"
    return f"{len(mine)} arrays here, {len(theirs)} there; lacks {lacks[:8]}, adds {adds[:8]}"


class State:
    """The state a worker keeps through faults, in horovod elastic's shape.

    Holds the model's parameters (every one, BatchNorm's running statistics too), the
    trainer's optimizer states and update counters, and any picklable values of the
    script (``extras``: epoch, position in the epoch, a metric...), which are read and
    written as attributes. :meth:`commit` copies all of it in memory at a step
    boundary; :meth:`restore` puts the last commit back; :meth:`sync` gives every rank
    rank 0's. :func:`dist_gluon.elastic.run` calls restore and sync for you when a
    node is lost or joins: the training function is entered again with the state of
    the last commit, on the new world.

    Parameters
    ----------
    net : gluon.Block, optional
        The model; all of ``net.collect_params()`` is kept.
    trainer : gluon.Trainer, optional
        Its optimizer states and counters are kept (a :class:`DistributedTrainer`, or any
        ``gluon.Trainer``); without ``net``, its parameters are.
    kv : Backend or str, optional
        The backend; by default the trainer's, else ``dist_gluon.create()``.
    **extras
        The script's own values, as attributes of the state (``state.epoch``). Only
        these names are kept: assigning another raises AttributeError.

    Examples
    --------
    >>> state = dg.elastic.State(net=net, trainer=trainer, epoch=0, done=0)
    >>> @dg.elastic.run
    ... def train(state):
    ...     for epoch in range(state.epoch, epochs):
    ...         state.epoch = epoch
    ...         sampler.set_epoch(epoch, skip=state.done)
    ...         for data, label in loader:
    ...             ...                           # forward, backward
    ...             trainer.step(batch_size)
    ...             state.done += batch_size * kv.num_workers
    ...             state.commit()
    ...         state.done = 0
    >>> train(state)
    """

    def __init__(self, net=None, trainer=None, kv: Backend | str | None = None,
                 **extras: Any):
        if net is None and trainer is None:
            raise ValueError("State needs the model (net=) or the trainer (trainer=)")
        if net is not None and not hasattr(net, "collect_params"):
            raise TypeError(f"net must be a gluon Block, got {type(net).__name__}")
        if trainer is not None and not hasattr(trainer, "_updaters"):
            raise TypeError(f"trainer must be a gluon.Trainer, got {type(trainer).__name__}")
        if getattr(trainer, "shard_optimizer_states", False):
            raise ValueError(
                "dg.elastic.State and DistributedTrainer(shard_optimizer_states=True) do not "
                "combine yet: each worker holds only its part of the optimizer states, so "
                "a lost worker's part would be lost with it and a re-formation onto "
                "another number of workers would need them re-sharded. Use "
                "shard_optimizer_states=False with dg.elastic.State, or dg.Checkpointer "
                "(which saves the whole states) for restarts")
        for name in extras:
            if name.startswith("_") or hasattr(type(self), name):
                raise ValueError(f"{name!r} cannot be a value of the state: it starts "
                                 "with '_' or names a method of State")
        if kv is None:
            kv = getattr(trainer, "kv", None)
        object.__setattr__(self, "_net", net)
        object.__setattr__(self, "_trainer", trainer)
        object.__setattr__(self, "_kv", resolve(kv))
        object.__setattr__(self, "_extras", dict(extras))
        object.__setattr__(self, "_callbacks", [])
        # two sets of copies in turn (module docstring); _good is the newest that is
        # known to be complete and clean
        object.__setattr__(self, "_snapshots", [_Snapshot(), _Snapshot()])
        object.__setattr__(self, "_good", None)
        object.__setattr__(self, "_commits", 0)
        # the job-wide number of the state held: rank 0's at the last sync, plus one per
        # commit since. Ranks with equal numbers hold the same state (replicas step
        # alike), so a sync among them sends nothing; None until the first sync
        object.__setattr__(self, "_serial", None)
        object.__setattr__(self, "_watch_stops", False)
        # ps-lite: the node's copy in shared memory that outlives this process
        # (dist_gluon.elastic.nodecopy); None elsewhere
        object.__setattr__(self, "_node_copy", None)

    # ------------------------------------------------------------------ extras
    def __getattr__(self, name: str):
        extras = object.__getattribute__(self, "_extras")
        if name in extras:
            return extras[name]
        raise AttributeError(f"the state has no value {name!r} (its values: "
                             f"{', '.join(sorted(extras)) or 'none'})")

    def __setattr__(self, name: str, value) -> None:
        if name not in self._extras:
            raise AttributeError(f"{name!r} is not a value of this state; give it to "
                                 f"State(..., {name}=...) so that commits keep it")
        self._extras[name] = value

    @property
    def kv(self) -> Backend:
        """The backend; its ``rank`` and ``num_workers`` are the current formation's."""
        return self._kv

    @property
    def commits(self) -> int:
        """How many commits this process made (sync's included)."""
        return self._commits

    @property
    def has_commit(self) -> bool:
        """Whether a commit completed that :meth:`restore` can put back."""
        return self._good is not None

    def watch_stops(self, on: bool) -> None:
        """Whether each :meth:`commit` asks the launcher for a re-formation at that step
        (dist_gluon.elastic.run turns it on under a launcher that re-forms jobs)."""
        object.__setattr__(self, "_watch_stops", bool(on))

    # ------------------------------------------------------------------ the API
    def commit(self) -> None:
        """Keep the current state in memory, then take part in a re-formation the
        launcher asked for (a node joins or leaves at a step boundary) by raising
        :class:`HostsUpdatedInterrupt` on every rank at this same commit.

        A collective once every rank calls it at the same point (at a step boundary,
        after ``trainer.step``), inside :func:`dist_gluon.elastic.run`: in an elastic
        job of several workers it sums one number over the workers, as
        :func:`dist_gluon.stop_requested` does. The copies run on MXNet's engine into
        arrays allocated at the first commit (no copy to NumPy); the commit returns
        once they are done, so a failure of this step's collectives raises here.
        """
        self._save()
        if self._watch_stops and stop._agreed_stop(self._kv):
            raise HostsUpdatedInterrupt("the launcher re-forms the job at this commit")

    def restore(self) -> None:
        """Put back the last commit that completed: parameters, optimizer states and
        counters, extras. Failures MXNet stored on the arrays (a collective that failed
        when a peer was lost) are cleared first."""
        clear_failures(self._arrays(grads=True))
        snapshot = self._good
        if snapshot is None:
            raise RuntimeError("restore() before any commit: call sync() or commit() "
                               "first (dist_gluon.elastic.run syncs before training)")
        self._put_back(snapshot)
        object.__setattr__(self, "_serial", snapshot.serial)
        object.__setattr__(self, "_good", snapshot)

    def sync(self) -> None:
        """Give every rank rank 0's state (a broadcast from memory: a new worker gets it
        from a live peer, never from a file), then commit it. A collective. Survivors
        that all went back to the same commit hold the same state already: then only
        that fact travels (one small gather), not the arrays.

        Workers restarted on ps-lite (which cannot keep their processes) first take
        their node's copy in shared memory (:mod:`dist_gluon.elastic.nodecopy`); then
        the freshest commit of the job comes from the lowest rank that holds it, not
        from rank 0 (the survivors of a lost worker can be one commit apart).

        What is each rank's own (a codec's residuals: what the rank held back from its
        sums) never travels: a rank that held no state starts it at zero, the others
        keep theirs, so nothing held back is sent twice."""
        kv = self._kv
        if self._node_copy is not None and self._serial is None:
            self._take_node_copy()
        serials = kv.allgather_object(self._serial) if kv.num_workers > 1 else [0]
        root = _freshest(serials) if self._node_copy is not None else 0
        if serials[root] is None or any(s != serials[root] for s in serials):
            # a new worker, or survivors that went back to different commits
            layout = kv.broadcast_object(self._layout(), root_rank=root)
            self._take_layout(layout)
            keys, arrays = self._keyed_arrays()
            if [list(k) for k in keys] != layout["keys"]:
                raise RuntimeError(f"this rank's model or optimizer differs from rank "
                                   f"{root}'s after the sync of their layouts: "
                                   f"{_key_difference(keys, layout['keys'])}")
            private = self._private_keys()
            shared = [(k, a) for k, a in zip(keys, arrays) if k not in private]
            names = [f"{_KEY}.{'.'.join(map(str, k))}" for k, _ in shared]
            outs = [self._all_copies(k, a) for k, a in shared]
            kv.broadcast_root(names, [a for _, a in shared], outs, root, 0)
            if self._serial is None:
                for k, a in zip(keys, arrays):
                    if k in private:
                        a[:] = 0
            object.__setattr__(self, "_serial", layout["serial"] or 0)
        elif self._serial is None:
            object.__setattr__(self, "_serial", 0)
        self._save()

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Functions to call, in order, each time the job re-formed and before the
        state is synced (e.g. to scale the learning rate to the new world size, or to
        rebuild a data loader whose shards depend on it)."""
        if callable(callbacks):
            callbacks = [callbacks]
        for fn in callbacks:
            if not callable(fn):
                raise TypeError(f"reset callbacks must be callable, got {fn!r}")
            self._callbacks.append(fn)

    def on_reset(self) -> None:
        """Run the reset callbacks (dist_gluon.elastic.run does, after a re-formation)."""
        for fn in self._callbacks:
            fn()

    # ------------------------------------------------------------------ the node's copy
    def use_node_copy(self, node_copy) -> None:
        """Commit to (and start from) the node's copy in shared memory
        (dist_gluon.elastic.run does, on backends whose workers restart)."""
        object.__setattr__(self, "_node_copy", node_copy)
        # the next commits allocate their copies there
        object.__setattr__(self, "_snapshots", [_Snapshot(), _Snapshot()])
        object.__setattr__(self, "_good", None)

    def _take_node_copy(self) -> None:
        """Put back the newest complete commit of this node's copy, if there is one."""
        held = self._node_copy.held()
        if held is None:
            return
        self._take_layout(held.layout)
        keys, arrays = self._keyed_arrays()
        if [list(k) for k in keys] != held.layout["keys"]:
            raise RuntimeError(f"this worker's model or optimizer differs from the one "
                               f"committed to the node's copy in "
                               f"{self._node_copy.directory}: the script must build the "
                               "same model and trainer every time it starts")
        saved = self._node_copy.arrays(held)
        # the node's copy is its writer's (local rank 0): another worker of the node
        # starts its own residuals at zero rather than send the writer's twice
        private = set() if self._node_copy.writer else self._private_keys()
        for k, a in zip(keys, arrays):
            if k in private:
                a[:] = 0
                continue
            for out in self._all_copies(k, a):
                saved[k].copyto(out)
        object.__setattr__(self, "_serial", held.serial)

    # ------------------------------------------------------------------ the copies
    def _save(self) -> None:
        target = next(s for s in self._snapshots if s is not self._good)
        keys, arrays = self._keyed_arrays()
        copies = target.arrays
        if set(copies) != set(keys) or any(
                copies[k].shape != a.shape or copies[k].dtype != a.dtype
                for k, a in zip(keys, arrays)):
            node_copy = self._node_copy
            if node_copy is not None and node_copy.writer:
                # the copies live in the node's shared memory, and outlive the process
                target.slot, copies = node_copy.allocate(keys, arrays)
            else:
                copies = {k: mx.nd.empty(a.shape, ctx=a.context, dtype=a.dtype)
                          for k, a in zip(keys, arrays)}
            target.arrays = copies
        for k, a in zip(keys, arrays):
            a.copyto(copies[k])
        target.counters = self._counters()
        target.extras = copy.deepcopy(self._extras)
        object.__setattr__(self, "_commits", self._commits + 1)
        if self._serial is not None:
            object.__setattr__(self, "_serial", self._serial + 1)
        target.serial = self._serial
        # A commit counts once its copies are known to be complete and clean: a failed
        # collective of this step stores its failure on them (through the update that
        # read its result), and is thrown here. Only here can it be told: once thrown
        # anywhere, MXNet clears the failure on every array that shares it. The wait is
        # for this step's own work (its updates, then the copies).
        try:
            for arr in copies.values():
                arr.wait_to_read()
        except MXNetError:
            clear_failures(copies.values())
            raise
        if target.slot is not None and self._serial is not None:
            self._node_copy.publish(target.slot, self._serial, self._layout(target))
        object.__setattr__(self, "_good", target)

    def _put_back(self, snapshot: _Snapshot) -> None:
        keys, arrays = self._keyed_arrays()
        saved = snapshot.arrays
        for k, a in zip(keys, arrays):
            if k in saved:
                for out in self._all_copies(k, a):
                    saved[k].copyto(out)
        # optimizer states created after that commit (a first step that failed) go, to
        # be created again by the next update
        for u, updater in enumerate(self._updaters()):
            for index in [i for i in updater.states if ("s", u, i, 0) not in saved
                          and optimizer_state_arrays(updater.states[i])]:
                del updater.states[index]
                updater.states_synced.pop(index, None)
        self._set_counters(snapshot.counters)
        self._extras.clear()
        self._extras.update(copy.deepcopy(snapshot.extras))

    # ------------------------------------------------------------------ what is kept
    def _params(self) -> list:
        if self._net is not None:
            return parameter_list(self._net.collect_params())
        return list(getattr(self._trainer, "model_params", None) or self._trainer._params)

    def _updaters(self) -> list:
        return list(self._trainer._updaters) if self._trainer is not None else []

    def _keyed_arrays(self) -> tuple[list[tuple], list[mx.nd.NDArray]]:
        """Every array kept, keyed: ('p', i) the first copy of parameter i (in the
        model's order), ('s', u, index, j) leaf j of updater u's state ``index``, ('t',
        name) the trainer's own (its ``extra_state()``: codec residuals, Local SGD's
        round)."""
        keys, arrays = [], []
        for i, param in enumerate(self._params()):
            if param._data is not None:
                keys.append(("p", i))
                arrays.append(param.list_data()[0])
        for u, updater in enumerate(self._updaters()):
            for index in sorted(updater.states):
                for j, leaf in enumerate(optimizer_state_arrays(updater.states[index])):
                    keys.append(("s", u, index, j))
                    arrays.append(leaf)
        extra = self._trainer_extra()[0]
        for name in sorted(extra):
            keys.append(("t", name))
            arrays.append(extra[name])
        return keys, arrays

    def _private_keys(self) -> set[tuple]:
        """The keys of the arrays that are each rank's own (the trainer's
        ``private_state_names()``: a codec's residuals)."""
        names = getattr(self._trainer, "private_state_names", None)
        return {("t", name) for name in names()} if names is not None else set()

    def _trainer_extra(self) -> tuple[dict, dict | None]:
        """The trainer's ``extra_state()``: ({}, None) for a trainer without one."""
        extra = getattr(self._trainer, "extra_state", None)
        return extra() if extra is not None else ({}, None)

    def _all_copies(self, key: tuple, array: mx.nd.NDArray) -> list[mx.nd.NDArray]:
        """Where a kept array lives: every device's copy of a parameter."""
        if key[0] == "p":
            return list(self._params()[key[1]].list_data())
        return [array]

    def _arrays(self, grads: bool = False) -> list[mx.nd.NDArray]:
        arrays = []
        for param in self._params():
            if param._data is not None:
                arrays.extend(param.list_data())
                if grads and param.grad_req != "null":
                    arrays.extend(param.list_grad())
        for updater in self._updaters():
            for state in updater.states.values():
                arrays.extend(optimizer_state_arrays(state))
        arrays.extend(self._trainer_extra()[0].values())
        return arrays

    def _counters(self) -> dict | None:
        """The optimizer's update counts (learning-rate schedules and Adam's bias
        correction follow them) and its schedule."""
        if self._trainer is None:
            return None
        return {**update_counters(self._trainer._optimizer),
                "trainer": self._trainer_extra()[1]}

    def _set_counters(self, counters: dict | None) -> None:
        if counters is None or self._trainer is None:
            return
        set_update_counters(self._trainer._optimizer, counters)
        if counters.get("trainer") is not None:
            self._trainer.set_extra_counters(counters["trainer"])

    def _layout(self, snapshot: _Snapshot | None = None) -> dict:
        """What a rank needs to receive rank 0's arrays: the parameters' shapes (a new
        worker's deferred parameters take them), which optimizer states exist, the
        counters and the extras; those of ``snapshot`` (a commit just made: its keys,
        counters and extras, not taken again), else the current ones."""
        if snapshot is None:
            keys, counters, extras = self._keyed_arrays()[0], self._counters(), self._extras
        else:
            keys, counters, extras = list(snapshot.arrays), snapshot.counters, snapshot.extras
        return {"shapes": [tuple(p.shape) if p._data is not None else None
                           for p in self._params()],
                "states": [[i for i in sorted(u.states) if optimizer_state_arrays(u.states[i])]
                           for u in self._updaters()],
                "keys": [list(k) for k in keys],
                "counters": counters, "extras": extras, "serial": self._serial}

    def _take_layout(self, layout: dict) -> None:
        params = self._params()
        if len(params) != len(layout["shapes"]):
            raise RuntimeError(f"this rank's model has {len(params)} parameters, rank "
                               f"0's {len(layout['shapes'])}")
        for param, shape in zip(params, layout["shapes"]):
            if shape is not None and param._data is None:
                param.shape = shape                 # a deferred parameter: rank 0's shape
                param._finish_deferred_init()
        trainer = self._trainer
        if trainer is not None:
            for u, (updater, wanted) in enumerate(zip(self._updaters(), layout["states"])):
                for index in [i for i in updater.states if i not in wanted]:
                    del updater.states[index]
                    updater.states_synced.pop(index, None)
                for index in wanted:
                    if index not in updater.states:
                        weight = trainer._params[index].list_data()[u]
                        updater.states[index] = \
                            updater.optimizer.create_state_multi_precision(index, weight)
                        updater.states_synced[index] = True
        self._set_counters(layout["counters"])
        self._extras.clear()
        self._extras.update(layout["extras"])
