"""Checkpoints that survive a crash, and restore them on every rank.

One checkpoint is one directory, ``<directory>/ckpt-000012/`` (numbered in save order):

``params.npz``
    The parameter values, keyed ``"0"``, ``"1"``, ... by position in
    ``net.collect_params()`` (names differ between ranks and runs, positions do not).
``trainer.states``
    The optimizer states and the optimizer, exactly as ``gluon.Trainer.save_states``
    writes them (so ``trainer.load_states`` can read it too): indexed in gluon.Trainer's
    order of the trainer's parameters (a ParameterDict sorted by name). meta.json maps
    each index to its position in ``net.collect_params()``, so a restore puts every
    state on its parameter whatever the names are now. Format 1 (written by dist_gluon
    0.2.0) indexed a DistributedTrainer's states by model position; a DistributedTrainer
    (or a peer's trainer) restoring such a checkpoint converts them. Absent without a
    trainer.
``compression.pkl``
    With a compressing DistributedTrainer: the codec's type and parameters, its state
    shared by every rank (PowerSGD's Q matrices and step counts) and every rank's own
    (residuals, PowerSGD's errors), so that a compressed run resumes exactly. Restored
    on another worker count, new rank ``r`` gets the sum of the saved residuals of ranks
    ``r, r + N', r + 2N', ...`` (``N'`` the new count): what every residual held back
    is sent once, by someone. On one process nothing is compressed and residuals are
    dropped.
``local_sgd.pkl``
    With a Local SGD or DiLoCo trainer (``sync_every``, :mod:`dist_gluon.local_sgd`):
    the position (steps taken, local steps of the round under way), the round's anchor
    (the global parameters), the outer optimizer and its states, the pseudo-gradient
    codec's state, and every rank's own optimizer states and, mid-round, its own
    parameters (trainer.states and params.npz hold rank 0's). Restored on the same
    number of workers, every rank continues exactly; on another number, new rank ``r``
    continues from saved rank ``r % N``'s parameters and optimizer states (``N`` the
    saved count), with the position, anchor and outer state unchanged, and residuals
    merged as for ``compression.pkl``.
``state.pkl``
    A pickle of ``{'epoch', 'step', 'extra', 'rng', 'amp'}``; ``rng`` holds the state of
    Python's ``random`` and NumPy's global generator of every rank, ``amp`` the state of
    the trainer's AMP loss scaler (``mx.contrib.amp.init_trainer``; None without one),
    so that a restored trainer continues with the same loss scale.
``meta.json``
    Format name and version, epoch, step, num_workers, backend, package versions, the
    parameters' names, shapes and dtypes, and the size and SHA-256 of every other file.

A save writes everything into a hidden temporary directory, fsyncs every file and the
directory, renames it to its final name and fsyncs the parent: a checkpoint directory
either is complete or does not exist, and a crash during a save leaves at most a
``.tmp-ckpt-*`` directory behind, which restore ignores and the next save deletes.
"""
from __future__ import annotations

import errno
import hashlib
import importlib.metadata
import io
import json
import os
import pickle
import platform
import random
import re
import shutil
import time
import warnings
from typing import Any

import mxnet as mx
import numpy as np
from mxnet import gluon
from mxnet.gluon.parameter import Parameter

from . import amp, jobcontrol, worker
from ._version import __version__
from .backends import Backend, resolve
from .broadcast import parameter_list
from .trainer import index_mapping, positions_in, remap_states, set_trainer_states

FORMAT = "dist_gluon.checkpoint"
# 2: trainer states in gluon.Trainer's order, mapped by meta.json's trainer_positions
FORMAT_VERSION = 2
_NAME = re.compile(r"^ckpt-(\d+)$")
_TEMP_PREFIX = ".tmp-ckpt-"
_META = "meta.json"
_PARAMS = "params.npz"
_TRAINER = "trainer.states"
_STATE = "state.pkl"
_COMPRESSION = "compression.pkl"
_LOCAL_SGD = "local_sgd.pkl"
# Arrays of these dtypes travel as tensors of their own dtype (one collective each);
# anything else in the optimizer states travels pickled with the small objects.
_TENSOR_DTYPES = {np.dtype(t) for t in ("float16", "float32", "float64", "uint8", "int8",
                                        "int32", "int64")}


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or restored: missing, truncated or corrupt files, a
    newer format, or a model that does not match the checkpoint. Raised on every rank."""


class Checkpointer:
    """Saves training checkpoints from rank 0 and restores them on every rank.

    ``save`` writes the parameters (by position in ``net.collect_params()``), the
    trainer's optimizer states, ``epoch``, ``step``, the Python and NumPy random states
    of every rank, a picklable ``extra`` and a metadata record with a checksum per file.
    Only rank 0 writes, atomically (see the module docstring); every rank returns once
    the checkpoint is on disk, and tells its launcher the ``epoch`` and ``step`` it
    saved (an elastic launcher re-forms the job at the newest checkpoint). The newest
    ``keep`` checkpoints are kept.

    ``restore`` loads the newest checkpoint that is intact into the model (and trainer)
    on every rank. Only rank 0 reads files, so the directory need not be visible to the
    other ranks. A truncated or corrupt checkpoint is skipped with a warning naming the
    bad file, and the one before it is used. Nothing in a checkpoint depends on the
    number of workers, so it can be restored on a different number. The position in
    the data is the script's to keep: with :class:`ShardSampler`, save how many
    positions of the epoch's order are done, ``skip + steps * batch_size *
    num_workers`` (per-worker batch size, ``skip`` the value this run started the epoch
    with), and resume with ``sampler.set_epoch(epoch, skip=done)``: exact on any
    number of workers (see the example).

    Each rank gets back its own Python and NumPy random state (a rank that did not
    exist at save time keeps its current one). MXNet's own generator (``mx.random``,
    used by dropout and random augmentation) cannot be read through MXNet's API, so it
    is neither saved nor restored: reseed it with ``mx.random.seed(...)`` after
    ``restore`` if you need that.

    Parameters
    ----------
    directory : str or os.PathLike
        Where the checkpoints live (created by the first save). Only rank 0's value is
        used; one Checkpointer per directory.
    kv : Backend, str or None, default None
        The backend, a backend name, or None to create it from the environment.
    keep : int or None, default 3
        How many of the newest checkpoints to keep (>= 1); None keeps all of them.
    node_local : bool, default False
        Keep every checkpoint on each node's own disk, for clusters without a shared
        file system and jobs that must survive the loss of any host: the first worker of
        every node (local rank 0) writes the whole checkpoint into ``directory`` on its
        node. The weights, optimizer states and codec states are the same on every
        rank after a step, and the random states and residuals are gathered by every
        rank anyway, so no checkpoint bytes cross the network, except the parameters
        that are not trained (BatchNorm's running statistics, rank 0's copy). Each node
        pays a full checkpoint's disk writes per save. Checkpoints are numbered by the
        job, so every node's ``ckpt-000012`` is the same checkpoint. ``restore`` takes
        the newest checkpoint that any node of the job holds intact, read by the lowest
        rank of a node that holds it and sent to every rank (one collective per array).

    Examples
    --------
    >>> ckpt = dg.Checkpointer('checkpoints', keep=3)
    >>> state = ckpt.restore(net, trainer)            # None on the first run
    >>> start, done = (state['epoch'], state['extra']['done']) if state else (0, 0)
    >>> for epoch in range(start, epochs):
    ...     skip = done if epoch == start else 0      # positions of this epoch done
    ...     sampler.set_epoch(epoch, skip=skip)       # ShardSampler: only the rest
    ...     for i, (data, label) in enumerate(loader):
    ...         ...                                   # forward, backward, trainer.step
    ...         done = skip + (i + 1) * batch_size * kv.num_workers
    ...         stop = dg.stop_requested()            # elastic jobs; the same on every rank
    ...         if stop or (i + 1) % 100 == 0:
    ...             ckpt.save(net, trainer, epoch, step=i + 1, extra={'done': done})
    ...         if stop:
    ...             sys.exit(0)                       # the launcher re-forms the job
    ...     ckpt.save(net, trainer, epoch + 1, extra={'done': 0})
    """

    def __init__(self, directory: str | os.PathLike, kv: Backend | str | None = None,
                 keep: int | None = 3, node_local: bool = False):
        directory = os.fspath(directory)
        if not directory:
            raise ValueError("directory must be a non-empty path")
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int)
                                 or keep < 1):
            raise ValueError(f"keep must be an int >= 1 or None (keep all), got {keep!r}")
        if not isinstance(node_local, bool):
            raise ValueError(f"node_local must be True or False, got {node_local!r}")
        self._directory = directory
        self._keep = keep
        self._node_local = node_local
        self._kv = resolve(kv)

    @property
    def directory(self) -> str:
        return self._directory

    @property
    def keep(self) -> int | None:
        return self._keep

    @property
    def node_local(self) -> bool:
        return self._node_local

    def __repr__(self) -> str:
        local = ", node_local=True" if self._node_local else ""
        return f"Checkpointer({self._directory!r}, keep={self._keep}{local})"

    def _writes(self) -> bool:
        """Whether this rank writes checkpoints: rank 0, or each node's first worker."""
        return self._kv.local_rank == 0 if self._node_local else self._kv.rank == 0

    # ------------------------------------------------------------------------ save
    def save(self, net, trainer: gluon.Trainer | None, epoch: int, step: int = 0,
             extra: Any = None) -> str:
        """Write a checkpoint from rank 0; every rank returns once it is durable.

        Every rank must call it, with the same ``epoch`` and ``step``.

        Parameters
        ----------
        net : Block, ParameterDict or list of Parameter
            The model; its parameters must be initialised (after the first forward for
            deferred initialisation).
        trainer : gluon.Trainer or None
            Its optimizer states (momentum, Adam's moments and update counts, the
            learning rate schedule) are saved too.
        epoch : int
            The epoch to resume in (>= 0), e.g. ``epoch + 1`` after an epoch ends.
        step : int, default 0
            How many batches of ``epoch`` are done (>= 0).
        extra : picklable, optional
            Anything else to keep (metrics, the best accuracy...); returned by restore.

        Returns
        -------
        str
            The checkpoint's directory (rank 0's path, on every rank).

        Raises
        ------
        CheckpointError
            On every rank, when rank 0 cannot write the checkpoint; the previous ones
            are untouched.
        """
        epoch = _check_count(epoch, "epoch")
        step = _check_count(step, "step")
        params = _parameters(net)
        if getattr(trainer, "updates_on_servers", False):
            trainer.sync_weights()      # dist_async: the servers' weights, on every rank
        rng = self._kv.allgather_object(_rng_state())
        codec = _codec(trainer)
        compression = None
        if codec is not None:
            local = codec.local_state()
            compression = {"type": codec.name, "params": codec.params,
                           "shared": codec.shared_state(),
                           "local": (self._kv.allgather_object(local)
                                     if self._kv.num_workers > 1 else [local])}
        local_sgd = _local_sgd_state(trainer, self._kv)
        # with shard_optimizer_states every rank holds a part: gathered on every rank
        states_file = trainer.whole_states_file() if hasattr(trainer, "whole_states_file") \
            else None
        number, untrained = None, None
        if self._node_local and self._kv.num_workers > 1:
            found = self._checkpoints() if self._writes() else []
            number = max(self._kv.allgather_object(found[-1][0] if found else 0)) + 1
            untrained = self._rank0_untrained(params)
        status, failure = None, None
        if self._writes():
            try:
                status = ("ok", self._write(params, trainer, epoch, step, extra, rng,
                                            compression, number, untrained, local_sgd,
                                            states_file))
            except Exception as err:  # every rank must hear about it, or they would hang
                status = ("error", f"rank {self._kv.rank} could not save a checkpoint in "
                                   f"{self._directory!r}: {type(err).__name__}: {err}")
                failure = err
        if self._kv.num_workers > 1:
            if self._node_local:
                statuses = [s for s in self._kv.allgather_object(status) if s is not None]
                status = next((s for s in statuses if s[0] == "error"), statuses[0])
            else:
                status = self._kv.broadcast_object(status)
        if status[0] == "error":
            raise CheckpointError(status[1]) from failure
        reporter = jobcontrol.reporter()
        if reporter is not None:
            # an elastic launcher re-forms the job at the newest checkpoint
            reporter.checkpoint_saved(epoch, step)
        return status[1]

    def _rank0_untrained(self, params: list) -> dict[int, np.ndarray]:
        """Rank 0's values of the parameters no optimizer updates (BatchNorm's running
        statistics differ between ranks), for every node's copy (as NumPy on the ranks
        that write); one collective each."""
        indices = [i for i, p in enumerate(params)
                   if p.grad_req == "null" and p._data is not None]
        values = [params[i].list_data()[0].copy() for i in indices]
        if values:
            self._kv.broadcast_root([f"__dg_ckpt.untrained.{i}" for i in indices], values,
                                    values, 0, 0)
        return {i: v.asnumpy() for i, v in zip(indices, values)} if self._writes() else {}

    def _write(self, params: list, trainer, epoch: int, step: int, extra, rng,
               compression, number: int | None = None,
               untrained: dict | None = None, local_sgd: dict | None = None,
               states_file: bytes | None = None) -> str:
        arrays = {}
        for i, p in enumerate(params):
            if p._data is None:
                raise CheckpointError(
                    f"parameter #{i} ({p.name!r}) is not initialised yet; with deferred "
                    "initialisation save after the first forward pass")
            arrays[str(i)] = untrained[i] if untrained and i in untrained else \
                p.list_data()[0].asnumpy()
        os.makedirs(self._directory, exist_ok=True)
        for name in os.listdir(self._directory):
            if name.startswith(_TEMP_PREFIX):   # left behind by a save that crashed
                shutil.rmtree(os.path.join(self._directory, name), ignore_errors=True)
        if number is None:
            number = max((n for n, _ in self._checkpoints()), default=0) + 1
        final = os.path.join(self._directory, f"ckpt-{number:06d}")
        temp = os.path.join(self._directory, f"{_TEMP_PREFIX}{number:06d}-{os.getpid()}")
        os.mkdir(temp)
        try:
            self._fill(temp, params, arrays, trainer, epoch, step, extra, rng, compression,
                       local_sgd, states_file)
            os.rename(temp, final)
        except BaseException:
            shutil.rmtree(temp, ignore_errors=True)
            raise
        _fsync_dir(self._directory)
        self._prune()
        return final

    def _fill(self, temp: str, params: list, arrays: dict, trainer, epoch: int, step: int,
              extra, rng, compression=None, local_sgd=None,
              states_file: bytes | None = None) -> None:
        """Write and fsync every file of a checkpoint into ``temp``, meta.json last."""
        files = {}
        with open(os.path.join(temp, _PARAMS), "wb") as f:
            np.savez(f, **arrays)
        files[_PARAMS] = _seal(os.path.join(temp, _PARAMS))
        if trainer is not None:
            # the base class writes the file itself; DistributedTrainer's would also
            # wait for the other ranks, which are waiting for this save
            if states_file is None:
                gluon.Trainer.save_states(trainer, os.path.join(temp, _TRAINER))
            else:
                with open(os.path.join(temp, _TRAINER), "wb") as f:
                    f.write(states_file)
            files[_TRAINER] = _seal(os.path.join(temp, _TRAINER))
        if compression is not None:
            with open(os.path.join(temp, _COMPRESSION), "wb") as f:
                pickle.dump(compression, f, protocol=4)
            files[_COMPRESSION] = _seal(os.path.join(temp, _COMPRESSION))
        if local_sgd is not None:
            with open(os.path.join(temp, _LOCAL_SGD), "wb") as f:
                pickle.dump(local_sgd, f, protocol=4)
            files[_LOCAL_SGD] = _seal(os.path.join(temp, _LOCAL_SGD))
        # AMP's loss scaler (the same on every rank): a restore continues with its scale
        state = {"epoch": epoch, "step": step, "extra": extra, "rng": rng,
                 "amp": amp.state(amp.loss_scaler(trainer))}
        with open(os.path.join(temp, _STATE), "wb") as f:
            pickle.dump(state, f, protocol=4)
        files[_STATE] = _seal(os.path.join(temp, _STATE))

        meta = {
            "format": FORMAT, "version": FORMAT_VERSION, "epoch": epoch, "step": step,
            "num_workers": self._kv.num_workers, "backend": self._kv.type,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "versions": _versions(self._kv.type),
            "parameters": [{"name": p.name, "shape": list(arrays[str(i)].shape),
                            "dtype": arrays[str(i)].dtype.name}
                           for i, p in enumerate(params)],
            "files": files,
        }
        if trainer is not None:
            meta["trainer_positions"] = positions_in(trainer._params, params)
        with open(os.path.join(temp, _META), "w") as f:
            json.dump(meta, f, indent=1)
        _seal(os.path.join(temp, _META))
        _fsync_dir(temp)

    def _checkpoints(self) -> list[tuple[int, str]]:
        """(number, path) of the finished checkpoints in the directory, oldest first."""
        try:
            names = os.listdir(self._directory)
        except FileNotFoundError:
            return []
        found = [(int(m.group(1)), os.path.join(self._directory, name))
                 for name in names if (m := _NAME.match(name))]
        return sorted(found)

    def _prune(self) -> None:
        if self._keep is None:
            return
        for _, path in self._checkpoints()[:-self._keep]:
            try:
                shutil.rmtree(path)
            except OSError as err:
                warnings.warn(f"could not delete the old checkpoint {path}: {err}",
                              stacklevel=4)

    # --------------------------------------------------------------------- restore
    def restore(self, net, trainer: gluon.Trainer | None = None,
                path: str | os.PathLike | None = None) -> dict | None:
        """Load the newest intact checkpoint (or ``path``) on every rank.

        Every rank must call it. Rank 0 reads and checks the files; the values reach
        the other ranks through the backend. Deferred-initialised parameters get the
        checkpoint's values at the first forward (instead of their initializer's, and
        before the trainer's first-forward broadcast, which then sends the same values).

        Parameters
        ----------
        net : Block, ParameterDict or list of Parameter
            The model, built as when it was saved; initialised (``net.initialize()``),
            possibly with deferred shapes.
        trainer : gluon.Trainer, optional
            Gets the saved optimizer and its states.
        path : str or os.PathLike, optional
            Restore this checkpoint instead of the newest one; a damaged one is an
            error. A bare name such as ``'ckpt-000012'`` is looked up in ``directory``;
            anything with a ``/`` is a path (``'./ckpt-000012'`` for the current one).

        Returns
        -------
        dict or None
            ``{'epoch', 'step', 'extra', 'path', 'num_workers'}`` (``num_workers`` at save
            time; with ``node_local``, ``path`` is the copy of the node that was read),
            or None when the directory holds no checkpoint. To continue inside
            ``epoch`` with :class:`ShardSampler`, on any number of workers, call
            ``sampler.set_epoch(epoch, skip=done)`` with the number of positions of
            the epoch's order that were done: ``step * batch_size * num_workers`` when
            the run that saved began the epoch at its start (per-worker batch size),
            or in general what the script kept in ``extra`` (see the class example).

        Raises
        ------
        CheckpointError
            On every rank: ``path`` is missing or damaged, every checkpoint in the
            directory is damaged, or the model does not match the checkpoint.
        """
        params = _parameters(net)
        kv = self._kv
        if getattr(trainer, "updates_on_servers", False) and trainer.servers_hold_weights:
            raise CheckpointError(
                "restore a dist_async trainer before its first step: its servers already "
                "hold weights, which its next pull would bring back")
        if self._node_local and kv.num_workers > 1:
            header, arrays, root, failure = self._read_node_local(path)
        else:
            root, (header, arrays, failure) = 0, self._read_here(path, kv.rank == 0)
            if kv.num_workers > 1:
                header = kv.broadcast_object(header)
        if header[0] == "none":
            if self._node_local and kv.rank == 0 and _restarted():
                warnings.warn(f"no node of this job holds a checkpoint in "
                              f"{self._directory!r}: starting from scratch", stacklevel=2)
            return None
        if header[0] == "error":
            raise CheckpointError(header[1]) from failure
        content = header[1]

        problem = _mismatch(params, content["parameters"], content["path"])
        problems = kv.allgather_object(problem) if kv.num_workers > 1 else [problem]
        for rank, message in enumerate(problems):
            if message is not None:
                raise CheckpointError(message if kv.num_workers == 1 else
                                      f"on rank {rank}: {message}")
        values = self._share(content["arrays"], arrays, root)

        for p, value in zip(params, values):
            p.set_data(value)   # deferred: kept and used as the initial value instead
        if trainer is not None:
            if content["trainer"] is None:
                if kv.rank == 0:
                    warnings.warn(f"checkpoint {content['path']} holds no trainer states; "
                                  "the trainer keeps its own", stacklevel=2)
            else:
                states, optimizer = content["trainer"]
                states = (_unflatten(states, values), optimizer)
                mapping = _state_mapping(trainer, params, content)
                if mapping is not None:
                    states = remap_states(states, mapping)
                set_trainer_states(trainer, pickle.dumps(states, protocol=4))
            _restore_codec(trainer, content.get("compression"), kv, content["path"])
            _restore_local_sgd(trainer, content.get("local_sgd"), kv, content["path"])
            amp.set_state(amp.loss_scaler(trainer), content.get("amp"))
        rng = content["rng"]
        if kv.rank < len(rng):
            _set_rng_state(rng[kv.rank])
        return {"epoch": content["epoch"], "step": content["step"],
                "extra": content["extra"], "path": content["path"],
                "num_workers": content["num_workers"]}

    def _read_here(self, path, reads: bool) -> tuple[tuple | None, list | None, Exception | None]:
        """This rank's reading of the checkpoint to restore when ``reads``: (header,
        arrays, the exception behind an error header)."""
        if not reads:
            return None, None, None
        try:
            header, arrays = self._read(path)
            return header, arrays, None
        except Exception as err:  # every rank must hear about it, or they would hang
            return ("error", f"rank {self._kv.rank} could not read a checkpoint in "
                             f"{self._directory!r}: {type(err).__name__}: {err}"), None, err

    def _read_node_local(self, path):
        """The newest checkpoint that some node holds intact: (header, arrays on the
        rank that read it, that rank, failure). Candidates go newest first; the lowest
        rank of a node holding one reads it and tells everyone whether it is intact."""
        kv = self._kv
        if path is not None:
            name = os.path.basename(os.path.normpath(os.fspath(path)))
            mine = [name] if self._writes() and os.path.isdir(self._resolve(path)) else []
        else:
            mine = [os.path.basename(p) for _, p in self._checkpoints()] \
                if self._writes() else []
        held = kv.allgather_object(mine)
        candidates = sorted({(name, rank) for rank, names in enumerate(held) for name in names},
                            key=lambda c: (-_number(c[0]), c[1]))
        reasons = []
        for name, holder in candidates:
            header, arrays, failure = self._read_here(name if path is None else path,
                                                      kv.rank == holder)
            header = kv.broadcast_object(header, root_rank=holder)
            if header[0] == "ok":
                return header, arrays, holder, failure
            reasons.append(f"rank {holder}: {header[1]}")
        if not candidates:
            if path is not None:
                return (("error", f"no node of this job holds checkpoint {path!r} in "
                                  f"{self._directory!r}"), None, 0, None)
            return ("none",), None, 0, None
        return (("error", f"no node's checkpoint in {self._directory!r} can be restored "
                          "(delete the damaged ones to start afresh):\n  "
                          + "\n  ".join(reasons)), None, 0, None)

    def _resolve(self, path) -> str:
        path = os.fspath(path)
        return os.path.join(self._directory, path) if os.sep not in path else path

    def _read(self, path) -> tuple[tuple, list | None]:
        """The reading rank: the broadcast header and the arrays of the checkpoint to
        restore."""
        if path is not None:
            path = self._resolve(path)
            if not os.path.isdir(path):
                return ("error", f"there is no checkpoint at {path!r}"), None
            try:
                return _load(path)
            except CheckpointError as err:
                return ("error", f"checkpoint {path} cannot be restored: {err}"), None
        found = self._checkpoints()
        if not found:
            return ("none",), None
        reasons = []
        for _, candidate in reversed(found):
            try:
                return _load(candidate)
            except CheckpointError as err:
                reasons.append(f"{candidate}: {err}")
                warnings.warn(f"skipping damaged checkpoint {candidate}: {err}; trying the "
                              "previous one", stacklevel=3)
        return ("error", f"no checkpoint in {self._directory!r} can be restored (delete "
                         "the damaged ones to start afresh):\n  " + "\n  ".join(reasons)), None

    def _share(self, specs: list, arrays: list | None, root: int = 0) -> list[mx.nd.NDArray]:
        """Rank ``root``'s arrays as NDArrays on every rank; one tensor collective per
        array."""
        kv = self._kv
        if kv.rank == root:
            values = [mx.nd.array(a, dtype=a.dtype) for a in arrays]
        else:
            values = [mx.nd.zeros(shape, dtype=dtype) for shape, dtype in specs]
        if kv.num_workers > 1 and values:
            # keys named by shape and dtype: ps-lite keys keep their first shape, and
            # another restore reuses the same server keys
            seen: dict[str, int] = {}
            keys = []
            for shape, dtype in specs:
                spec = f"{dtype}.{'x'.join(map(str, shape))}"
                seen[spec] = seen.get(spec, -1) + 1
                keys.append(f"__dg_ckpt.{spec}.{seen[spec]}")
            kv.broadcast_root(keys, values, values, root, 0)
            for v in values:
                v.wait_to_read()
        return values


# --------------------------------------------------------------------------- reading
def _load(path: str) -> tuple[tuple, list]:
    """Check and parse one checkpoint: (("ok", content), arrays), or CheckpointError
    naming the damaged file."""
    meta_path = os.path.join(path, _META)
    try:
        with open(meta_path, "rb") as f:
            meta = json.loads(f.read().decode("utf-8"))
        if meta.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} record")
        version, specs = int(meta["version"]), list(meta["parameters"])
        saved_workers = int(meta["num_workers"])
        files = {name: (int(r["bytes"]), str(r["sha256"])) for name, r in meta["files"].items()}
    except FileNotFoundError:
        raise CheckpointError(f"{meta_path} is missing") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(f"{meta_path} is damaged ({type(err).__name__}: {err})") from None
    if version > FORMAT_VERSION:
        raise CheckpointError(f"{meta_path}: format version {version} was written by a "
                              f"newer dist_gluon (this one reads up to {FORMAT_VERSION})")

    data = {}
    for name, (size, sha256) in files.items():
        file = os.path.join(path, name)
        try:
            with open(file, "rb") as f:
                data[name] = f.read()
        except OSError as err:
            raise CheckpointError(f"{file} cannot be read ({err})") from None
        if len(data[name]) != size:
            raise CheckpointError(f"{file} is truncated or damaged: {len(data[name])} bytes, "
                                  f"{size} expected")
        if hashlib.sha256(data[name]).hexdigest() != sha256:
            raise CheckpointError(f"{file} is corrupt: its SHA-256 checksum does not match "
                                  f"{meta_path}")
    for name in (_PARAMS, _STATE):
        if name not in data:
            raise CheckpointError(f"{meta_path} lists no {name}")

    def parse(name, how):
        try:
            return how(data[name])
        except Exception as err:
            raise CheckpointError(f"{os.path.join(path, name)} cannot be loaded "
                                  f"({type(err).__name__}: {err})") from None

    def read_params(raw):
        with np.load(io.BytesIO(raw), allow_pickle=False) as npz:
            if len(npz.files) != len(specs):
                raise ValueError(f"{len(npz.files)} arrays, {meta_path} lists {len(specs)}")
            return [npz[str(i)] for i in range(len(specs))]

    def read_state(raw):
        state = pickle.loads(raw)
        return {key: state.get(key) for key in ("epoch", "step", "extra", "rng", "amp")}

    arrays = parse(_PARAMS, read_params)
    state = parse(_STATE, read_state)
    compression = parse(_COMPRESSION, pickle.loads) if _COMPRESSION in data else None
    local_sgd = parse(_LOCAL_SGD, pickle.loads) if _LOCAL_SGD in data else None
    trainer = None
    if _TRAINER in data:
        states, optimizer = parse(_TRAINER, pickle.loads)
        trainer = (_flatten(states, arrays), optimizer)
    content = {"path": path, "epoch": state["epoch"], "step": state["step"],
               "extra": state["extra"], "rng": state["rng"], "amp": state.get("amp"),
               "num_workers": saved_workers, "parameters": specs, "trainer": trainer,
               "compression": compression, "local_sgd": local_sgd, "version": version,
               "trainer_positions": meta.get("trainer_positions"),
               "arrays": [(a.shape, a.dtype.name) for a in arrays]}
    return ("ok", content), arrays


class _Slot:
    """Stands for the array at ``index`` of the shared arrays in a flattened object."""

    def __init__(self, index: int):
        self.index = index


def _flatten(obj, arrays: list):
    """``obj`` with its dense NDArrays moved (as NumPy arrays) to the end of ``arrays``."""
    if isinstance(obj, mx.nd.NDArray) and obj.stype == "default" and obj.ndim > 0 \
            and obj.size > 0 and np.dtype(obj.dtype) in _TENSOR_DTYPES:
        arrays.append(obj.asnumpy())
        return _Slot(len(arrays) - 1)
    if type(obj) in (list, tuple):
        return type(obj)(_flatten(item, arrays) for item in obj)
    if type(obj) is dict:
        return {key: _flatten(value, arrays) for key, value in obj.items()}
    return obj


def _unflatten(obj, values: list):
    if isinstance(obj, _Slot):
        return values[obj.index]
    if type(obj) in (list, tuple):
        return type(obj)(_unflatten(item, values) for item in obj)
    if type(obj) is dict:
        return {key: _unflatten(value, values) for key, value in obj.items()}
    return obj


# --------------------------------------------------------------------------- applying
def _parameters(net) -> list:
    params = parameter_list(net.collect_params() if hasattr(net, "collect_params") else net)
    for item in params:
        if not isinstance(item, Parameter):
            raise TypeError("net must be a gluon Block, a ParameterDict or a list of "
                            f"Parameters, got an item of type {type(item).__name__}")
    return params


def _mismatch(params: list, specs: list, path: str) -> str | None:
    """Why the checkpoint's parameters do not fit ``params``, or None."""
    if len(params) != len(specs):
        return (f"checkpoint {path} holds {len(specs)} parameters but the model has "
                f"{len(params)}; build the model as it was when the checkpoint was saved")
    problems = []
    for i, (p, spec) in enumerate(zip(params, specs)):
        shape, dtype = tuple(spec["shape"]), np.dtype(spec["dtype"])
        if p._data is None and not p._deferred_init:
            problems.append(f"parameter #{i} ({p.name!r}) is not initialised; call "
                            "net.initialize() before restore")
            continue
        mine = tuple(p.shape) if p.shape is not None else None
        fits = mine is None or (len(mine) == len(shape) and all(
            m in (0, -1, s) if p._data is None else m == s for m, s in zip(mine, shape)))
        if not fits or np.dtype(p.dtype) != dtype:
            problems.append(f"parameter #{i}: the model has {p.name!r} shape {mine} "
                            f"{np.dtype(p.dtype).name}, the checkpoint has {spec['name']!r} "
                            f"shape {shape} {dtype.name}")
    if problems:
        return (f"the model does not match checkpoint {path}:\n  "
                + "\n  ".join(problems[:10]))
    return None


def _codec(trainer):
    """The compression codec of a DistributedTrainer, or None."""
    return getattr(trainer, "codec", None)


def _state_mapping(trainer, params: list, content: dict) -> dict[int, int] | None:
    """Saved optimizer index -> this trainer's index, or None when they are the same."""
    mine = positions_in(trainer._params, params)
    saved = content.get("trainer_positions")
    if saved is None:
        model_params = getattr(trainer, "model_params", None)
        if content.get("version", 1) >= 2 or model_params is None:
            return None
        # format 1: a dist_gluon trainer indexed its states by model position
        saved = positions_in(model_params, params)
    if saved == mine or None in saved or None in mine:
        return None
    mapping = index_mapping(saved, mine)
    missing = [position for old, position in enumerate(saved) if old not in mapping]
    if missing:
        raise CheckpointError(
            f"checkpoint {content['path']} holds optimizer states of parameters at "
            f"positions {missing[:10]} of the model, which this trainer does not train; "
            "give the trainer the parameters it was saved with")
    return mapping


def _restore_codec(trainer, saved: dict | None, kv: Backend, path: str) -> None:
    """Give ``trainer``'s codec the saved state, this rank's residuals by the rule of
    the module docstring."""
    codec = _codec(trainer)
    if codec is None or saved is None:
        if codec is not None and kv.rank == 0:
            warnings.warn(f"checkpoint {path} holds no compression state (saved without "
                          f"compression): {codec.name} starts with empty residuals",
                          stacklevel=3)
        return
    if saved["type"] != codec.name:
        if kv.rank == 0:
            warnings.warn(f"checkpoint {path} holds {saved['type']} compression state; "
                          f"this trainer uses {codec.name}, which starts afresh",
                          stacklevel=3)
        return
    codec.load_state(saved["shared"], _merged_residuals(saved["local"], kv))


def _merged_residuals(saved_local: list[dict], kv: Backend) -> dict:
    """This rank's codec residuals: the sum of those of saved ranks ``rank, rank + N',
    ...`` (``N'`` this job's worker count)."""
    workers = max(kv.num_workers, 1)
    local: dict = {}
    for old_rank, state in enumerate(saved_local):
        if old_rank % workers != kv.rank:
            continue
        for field, values in state.items():
            merged = local.setdefault(field, {})
            for index, value in values.items():
                merged[index] = merged[index] + value if index in merged else np.array(value)
    return local


def _local_sgd_state(trainer, kv: Backend) -> dict | None:
    """A Local SGD trainer's state (local_sgd.pkl): what every rank shares, and every
    rank's own optimizer states (by model position) and, mid-round, parameters."""
    rounds = getattr(trainer, "_local_sgd", None)
    if rounds is None:
        return None
    positions = trainer.optimizer_positions()
    inner = {positions[i]: state for i, state in trainer._updaters[0].states.items()
             if positions[i] is not None}
    weights = None
    if rounds.in_round > 0:
        weights = {i: p.list_data()[0].asnumpy() for i, p in enumerate(trainer.model_params)
                   if p.grad_req != "null"}
    mine = {"inner": pickle.dumps(inner, protocol=4), "weights": weights,
            **rounds.local_state()}
    return {"shared": rounds.shared_state(),
            "local": kv.allgather_object(mine) if kv.num_workers > 1 else [mine]}


def _restore_local_sgd(trainer, saved: dict | None, kv: Backend, path: str) -> None:
    """Give a Local SGD trainer its position, anchor and outer state, and this rank its
    saved rank's parameters and optimizer states (module docstring)."""
    rounds = getattr(trainer, "_local_sgd", None)
    if rounds is None or saved is None:
        if kv.rank == 0 and (rounds is not None or saved is not None):
            warnings.warn(
                f"checkpoint {path} was saved " + ("without" if saved is None else "with")
                + " Local SGD (sync_every) and this trainer runs "
                + ("with" if saved is None else "without") + " it: every rank continues from "
                "rank 0's parameters and optimizer states"
                + (", and the first round starts now" if saved is None else ""), stacklevel=3)
        return
    model = trainer.model_params
    ctx_of = {i: p.list_ctx()[0] for i, p in enumerate(model)}
    rounds.load_shared_state(saved["shared"], ctx_of)
    mine = saved["local"][kv.rank % len(saved["local"])]
    rounds.load_local_state(mine, ctx_of)
    index_of = {position: i for i, position in enumerate(trainer.optimizer_positions())}
    inner = pickle.loads(mine["inner"])
    set_trainer_states(trainer, pickle.dumps(
        {index_of[position]: state for position, state in inner.items()}, protocol=4))
    for position, value in (mine["weights"] or {}).items():
        param = model[position]
        if param._data is None and kv.num_workers > 1:
            warnings.warn(f"{param.name!r} is not initialised yet (deferred): rank "
                          f"{kv.rank} continues the round from rank 0's value of it; "
                          "restore after the first forward to continue each rank's own",
                          stacklevel=3)
        param.set_data(mx.nd.array(value, dtype=value.dtype))
    codec = rounds.codec
    shared_codec = saved["shared"].get("codec")
    if codec is not None and shared_codec is not None and shared_codec["type"] == codec.name:
        codec.load_state(shared_codec["shared"],
                         _merged_residuals([m["codec"] or {} for m in saved["local"]], kv))


def _number(name: str) -> int:
    match = _NAME.match(name)
    return int(match.group(1)) if match else -1


def _restarted() -> bool:
    """Whether this job was started again by its launcher (a restart or re-formation)."""
    place = worker.context()
    return place.restart > 0 or place.reformation > 0


def _rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state()}


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


# --------------------------------------------------------------------------- files
def _seal(path: str) -> dict:
    """fsync ``path`` and return its size and SHA-256."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
            size += len(chunk)
        os.fsync(f.fileno())
    return {"bytes": size, "sha256": digest.hexdigest()}


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise   # (some file systems cannot sync a directory; nothing to do there)
    finally:
        os.close(fd)


def _versions(backend: str) -> dict:
    def version(package):
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None

    found = {"dist_gluon": __version__, "mxnet": mx.__version__,
             "numpy": np.__version__, "python": platform.python_version()}
    if backend == "horovod":
        found["horovod"] = version("horovod")
    return found


def _check_count(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return int(value)


__all__ = ["Checkpointer", "CheckpointError", "FORMAT", "FORMAT_VERSION"]
