"""The combination matrix of tests/test_matrix.py: its axes, the pairs that cannot meet,
and the covering array (allpairspy) grouped into launched jobs.

Every feature must compose with every other (../shared/DESIGN.md, "Features compose"):
each row of the covering array is one training run, compared with a one-process replay
of the same batches (tests/workers/matrix_cases.py). A covering array of strength 2 puts
every pair of axis values into at least one row; strength 3 (``make test-matrix``) every
triple.

A launched job costs seconds of start-up, so the rows are grouped by the axes that need
a job of their own (``LAUNCH_AXES``: the backend, and the sync check with the timeline,
which are the job's environment and launcher flags); the other axes vary inside one job,
which runs its rows one after the other, each with a fresh model and trainer under its
own prefix. Adding an axis value is one line in ``AXES`` (and a constraint if it cannot
meet some other value); the worker reads the value by the axis's name.
"""
from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Iterator

# axis -> its values; the first value is the feature switched off (or the most common)
AXES: dict[str, tuple] = {
    "backend": ("gloo", "mpi", "dist_sync", "p3"),
    "observe": ("off", "check_and_timeline"),     # DG_CHECK_SYNC=1 and --timeline
    "path": ("step", "allreduce_update", "module", "compat_hvd"),
    "codec": ("none", "fp16", "2bit", "powersgd", "topk"),
    "amp": ("off", "overflow"),       # dynamic loss scaling; one step overflows on rank 1
    "accumulate": ("off", "add"),     # grad_req='add', two micro-batches per step
    "syncbn": ("off", "on"),
    "sparse": ("off", "embedding"),   # row_sparse gradient of an Embedding
    "local_sgd": ("off", "sync_every"),
    "devices": (1, 2),                # mx.cpu(0) and mx.cpu(1) in each worker
    "shard": ("off", "states"),       # shard_optimizer_states=True
    "fault": ("none", "restart"),     # checkpoint at mid-run, restored onto 1 process
    "uneven": ("off", "join"),        # rank 1 has one batch fewer, in a dg.Join block
}
# amp too: mx.contrib.amp.init() changes MXNet's operators for the rest of the process
LAUNCH_AXES = ("backend", "observe", "amp")

Row = dict
# (why the values cannot meet, predicate on a partial row that is True when they do)
Constraint = tuple[str, Callable[[Row], bool]]


def _on(row: Row, axis: str) -> bool:
    """The axis is set in this (partial) row and not to its first value (switched off)."""
    return axis in row and row[axis] != AXES[axis][0]


def _is(row: Row, axis: str, *values) -> bool:
    return axis in row and row[axis] in values


# Pairs that cannot meet, by design of the feature or of the comparison.
CONSTRAINTS: list[Constraint] = [
    # The Module API builds its network from symbols and steps through
    # DistributedOptimizer: AMP's init_trainer takes a Gluon Trainer only (TypeError for
    # an Optimizer), and SyncBatchNorm, grad_req='add' through a Trainer, Local SGD,
    # sharded states and Checkpointer(net, trainer) are Gluon trainer features.
    ("the Module API has no Gluon trainer",
     lambda r: not (_is(r, "path", "module") and any(
         _on(r, a) for a in ("amp", "accumulate", "syncbn", "sparse", "local_sgd", "shard",
                             "fault")))),
    # dist_gluon.compat.horovod.DistributedTrainer is horovod's: Compression.none or
    # .fp16 only, and none of dist_gluon's own trainer keywords (sync_every,
    # shard_optimizer_states).
    ("the compat trainer takes horovod's codecs and keywords only",
     lambda r: not (_is(r, "path", "compat_hvd") and (
         _is(r, "codec", "2bit", "powersgd", "topk") or _on(r, "local_sgd")
         or _on(r, "shard")))),
    # A row_sparse gradient is a TypeError for 2-bit, PowerSGD and BytePS's compressors
    # (docs/compression.md), and the sharded states shard dense gradients only (a
    # TypeError in dist_gluon/sharding.py).
    ("codecs other than fp16 and sharded states refuse row_sparse gradients",
     lambda r: not (_on(r, "sparse") and (_is(r, "codec", "2bit", "powersgd", "topk")
                                          or _on(r, "shard")))),
    # MXNet's sparse Embedding computes its weight gradient with req=write only (an
    # MXNetError "SparseEmbedding layer doesn't support weight gradient calculation
    # with req != write").
    ("MXNet cannot accumulate a row_sparse Embedding gradient",
     lambda r: not (_on(r, "sparse") and _on(r, "accumulate"))),
    # Local SGD steps each worker's own optimizer on its own gradients, which needs its
    # whole state: refused when the trainer is built (dist_gluon/trainer.py).
    ("sharded optimizer states refuse Local SGD", lambda r: not (_on(r, "local_sgd")
                                                                 and _on(r, "shard"))),
    # The one-process replay of a Local SGD round restored onto another world size needs
    # the simulated workers of the round in flight; tests/test_local_sgd.py checks that
    # restore on its own.
    ("a Local SGD round restored onto one process has no one-process replay here",
     lambda r: not (_on(r, "local_sgd") and _on(r, "fault"))),
    # The replay simulates Local SGD's workers apart, but SyncBatchNorm couples their
    # forward passes (statistics over every worker's samples at every step).
    ("the Local SGD replay cannot simulate SyncBatchNorm's coupled workers",
     lambda r: not (_on(r, "local_sgd") and _on(r, "syncbn"))),
    # MXNet's Module on several devices sums them in its own kvstore ('local'), which
    # the DistributedOptimizer replaces with kvstore=None: one device per Module worker.
    ("the Module path runs one device per worker",
     lambda r: not (_is(r, "path", "module") and _is(r, "devices", 2))),
    # SyncBatchNorm sums its statistics in float64 on horovod; after
    # mx.contrib.amp.init() AMP's widest-type casts make the operators that meet those
    # sums float64 ones, which MKLDNN cannot run (found by this matrix: it trained wrong
    # without a word). Refused at the layer's first training forward
    # (dist_gluon/syncbn.py _AMP_HELP; test_syncbn.py proves the refusal); dist_sync and
    # p3 (float32 all-gather) compose with AMP.
    ("SyncBatchNorm on horovod refuses AMP",
     lambda r: not (_is(r, "backend", "gloo", "mpi") and _on(r, "syncbn")
                    and _on(r, "amp"))),
    # dg.Join does not shadow Local SGD rounds: refused when the block is entered
    # (dist_gluon/join.py).
    ("dg.Join refuses Local SGD", lambda r: not (_on(r, "uneven") and _on(r, "local_sgd"))),
    # horovod.mxnet's trainer averages over the workers, whatever their samples (the
    # rank that left counts as one with the mean batch): tests/test_join.py checks that
    # arithmetic; the replay here is one process on the samples present.
    ("the compat trainer's dg.Join averages over workers, not over samples",
     lambda r: not (_on(r, "uneven") and _is(r, "path", "compat_hvd"))),
    # A rank that left cannot shadow SyncBatchNorm's in-process meeting of a worker's
    # devices: a JoinError naming the layer ends the job (docs/uneven-inputs.md).
    ("dg.Join cannot shadow SyncBatchNorm over several devices of a worker",
     lambda r: not (_on(r, "uneven") and _on(r, "syncbn") and _is(r, "devices", 2))),
    # The Module replay binds one batch shape; dg.Join with the Module API is checked
    # against one process in tests/test_join.py.
    ("the Module replay has one batch shape",
     lambda r: not (_on(r, "uneven") and _is(r, "path", "module"))),
]

# Known bugs being fixed on other branches: the lead removes each constraint after
# merging its fix, and the matrix then covers the pairs again.
KNOWN_BUGS: list[Constraint] = [
    # Found by this matrix (reported, needs a decision: docs or a refusal): with Local
    # SGD, 2-bit compresses the round's weight difference against its absolute
    # threshold (0.5): every element under it stays in the residual, and after 2 rounds
    # of 2 steps the weights have not moved at all (one process moved them 0.33).
    ("matrix finding: 2-bit with Local SGD does not move the weights",
     lambda r: not (_is(r, "codec", "2bit") and _on(r, "local_sgd"))),
]


def allowed(row: Row) -> bool:
    """False when two values of the (partial) row cannot meet."""
    return all(ok(row) for _, ok in CONSTRAINTS + KNOWN_BUGS)


def covering_rows(strength: int = 2) -> list[Row]:
    """A covering array of ``strength`` over ``AXES``: every allowed combination of
    ``strength`` values of different axes appears in at least one row."""
    from allpairspy import AllPairs

    names = list(AXES)
    rows = [dict(zip(names, values)) for values in AllPairs(
        [list(AXES[a]) for a in names],
        filter_func=lambda values: allowed(dict(zip(names, values))), n=strength)]
    # allpairspy builds each row greedily from the left and gives up on the combinations
    # whose row its filter rejects part-way (29 of the pairs here): each of those gets a
    # row of its own, completed with the values that cover the most still missing ones.
    missing = missing_tuples(rows, strength)
    while missing:
        row = dict(missing[0])
        for axis in names:
            if axis not in row:
                row[axis] = max((v for v in AXES[axis] if allowed({**row, axis: v})),
                                key=lambda v: _covered({**row, axis: v}, missing))
        rows.append(row)
        missing = [t for t in missing if not _contains(row, t)]
    return rows


def _contains(row: Row, combination: Row) -> bool:
    return all(row.get(a) == v for a, v in combination.items())


def _covered(row: Row, combinations: list[Row]) -> int:
    return sum(_contains(row, t) for t in combinations)


def required_tuples(strength: int = 2) -> Iterator[Row]:
    """Every allowed combination of ``strength`` values of different axes."""
    for axes in itertools.combinations(AXES, strength):
        for values in itertools.product(*(AXES[a] for a in axes)):
            row = dict(zip(axes, values))
            if allowed(row):
                yield row


def missing_tuples(rows: list[Row], strength: int = 2) -> list[Row]:
    """The allowed combinations of ``strength`` values that no row contains."""
    return [t for t in required_tuples(strength) if not any(_contains(row, t) for row in rows)]


def case_name(index: int, row: Row) -> str:
    """A row's name: its index and the values that are switched on, e.g.
    ``07-step-fp16-syncbn-devices2``; also the prefix of its trainer."""
    parts = [f"{index:02d}", str(row["path"])]
    parts += [f"{a}{row[a]}" if a == "devices" else a if row[a] == "on" else str(row[a])
              for a in AXES if a not in LAUNCH_AXES and a != "path" and _on(row, a)]
    return "-".join(parts)


def jobs(strength: int = 2) -> dict[tuple, list[tuple[str, Row]]]:
    """The covering rows grouped by their launch-level values: (backend, observe) ->
    [(case name, row), ...], run in order by one launched job."""
    grouped = collections.defaultdict(list)
    for index, row in enumerate(covering_rows(strength)):
        grouped[tuple(row[a] for a in LAUNCH_AXES)].append((case_name(index, row), row))
    return dict(grouped)
