"""The worker's side of a re-formation that keeps its process: :func:`run`.

Under ``dist_gluon.launch --nnodes MIN:MAX`` a worker that enters a function decorated
with :func:`run` tells its launcher, through its job-control record, that it keeps its
process through re-formations. When a node is lost (or joins, or leaves at a step
boundary), the launchers then re-form the job around the live workers instead of
restarting them:

1. The launcher ends the worker's round (the record's ``abort``). A thread of the worker
   that watches the record breaks the collectives still pending on the round's Gloo
   connections (a peer that vanished would otherwise keep them waiting for Gloo's
   timeout), so the training function raises wherever it waits for one.
2. :func:`run` catches that failure, puts back the last commit (:meth:`State.restore`),
   and parks: it waits in the record for its next round.
3. The launcher hands it the next round (rank, world size, Gloo rendezvous); the backend
   shuts horovod down and initialises it again in this process (``_reform``).
4. The reset callbacks run, rank 0's state reaches every rank from memory
   (:meth:`State.sync`, a broadcast: a new worker heals from a live peer), and the
   training function is entered again.

A planned re-formation (a node joins, or one is preempted) ends the round at a commit
instead (:class:`HostsUpdatedInterrupt`, on every rank at the same commit): nothing is
lost. A failure that is not a lost peer (a bug in the script) ends the worker as
before.
"""
from __future__ import annotations

import functools
import re
import threading
import time

from .. import jobcontrol, worker
from ..backends.horovod import RoundEnded
from .nodecopy import NodeCopy
from .state import HostsUpdatedInterrupt, State

# what a collective that lost its peers says (horovod's shutdown after a Gloo error)
_LOST_PEER = re.compile(r"Horovod has been shut down|gloo|Connection reset|Connection "
                        r"closed|Connection abort|Broken pipe|Timed out waiting",
                        re.IGNORECASE)
_WATCH_EVERY = 0.01     # seconds between two looks of the watching thread at the record


class _Session:
    """This process's part in the job's rounds: its record, its round, the thread that
    breaks a round's collectives when the launcher ends it."""

    def __init__(self, state: State, reporter: jobcontrol.Reporter):
        self.state, self.reporter = state, reporter
        self.round = worker.context().restart
        self._lock = threading.Lock()
        self._broken: int | None = None     # the round whose collectives were broken
        reporter.keep_process()
        threading.Thread(target=self._watch, name="dg-elastic-watch", daemon=True).start()

    def _watch(self) -> None:
        while True:
            time.sleep(_WATCH_EVERY)
            ended = self.reporter.round_aborted()
            with self._lock:
                if ended is not None and ended >= self.round and self._broken != self.round:
                    self._broken = self.round
                    self.state.kv._abort()

    def lost_peer(self, error: BaseException) -> bool:
        """Whether ``error`` is the round's end: a collective that lost its peers, or
        anything raised once the launcher ended the round."""
        ended = self.reporter.round_aborted()
        return bool(_LOST_PEER.search(str(error))) or (
            ended is not None and ended >= self.round)

    def next_round(self) -> None:
        """Wait for the launcher to hand this worker its next round, and join it (or
        the one after, if that round ends before all its ranks met)."""
        while True:
            self.reporter.park(self.round)
            while True:
                handed = self.reporter.next_round()
                if handed is not None and handed[0] > self.round:
                    break
                time.sleep(_WATCH_EVERY)
            number, environ = handed
            with self._lock:
                self.reporter.entered_round()
                self.round = number
                # the new rank, world size and round, for every module that reads the
                # worker's place (the timeline, the sync check's messages...)
                worker.context().update(environ)
                try:
                    self.state.kv._reform(environ)
                    return
                except RoundEnded:
                    continue            # horovod was not initialised: wait again


def _session(state: State) -> _Session | None:
    reporter = jobcontrol.reporter()
    if reporter is None or not worker.context().elastic or not state.kv._can_reform():
        # ps-lite and MPI: a change of the job restarts the workers (from checkpoints)
        return None
    problem = state.kv._reform_problem()
    if problem is not None:
        # refused before the first step: at the first fault it would crash the survivors
        raise RuntimeError(f"dist_gluon.elastic.run: {problem}")
    return _Session(state, reporter)


def _node_copy(state: State) -> NodeCopy | None:
    """ps-lite (whose workers restart on every change of the job): the node's copy of
    the state in shared memory that the launcher gave this worker, if any."""
    reporter = jobcontrol.reporter()
    if reporter is None or not worker.context().elastic or state.kv._can_reform():
        return None
    node_copy = NodeCopy.from_environment(state.kv.local_rank)
    if node_copy is not None:
        reporter.commit_to_node()
    return node_copy


def run(func):
    """Decorate ``train(state, ...)`` so that it outlives lost and joining nodes.

    The function is entered with every rank holding rank 0's state (:meth:`State.sync`).
    When a node is lost, the collective that fails raises on every survivor; the state
    goes back to its last commit, the job re-forms around the surviving processes (on
    horovod: ``hvd.shutdown()`` and ``hvd.init()`` in the same process, with the new
    rendezvous), the reset callbacks run, rank 0's state is synced to every rank (new
    workers included) and the function is entered again. The backend's ``rank`` and
    ``num_workers`` are then the new formation's. When nodes join, or one is preempted,
    the same happens at a :meth:`State.commit` (nothing is lost). What the function
    returns is returned.

    Under ``dist_gluon.launch --nnodes MIN:MAX --backend horovod`` this is what keeps
    the workers' processes through re-formations (the launcher learns it from the
    worker's record). On ``dist_sync``, ``p3`` and ``dist_async`` (ps-lite starts once
    per process) the workers restart instead, but every commit also lands in the
    node's shared memory (:mod:`dist_gluon.elastic.nodecopy`): the restarted workers
    enter the function with the freshest commit of the job, taken from memory (never
    from a checkpoint), and a joining node's workers get it from a live peer. At a
    planned change the workers end at that commit (``SystemExit(0)``) and are started
    again on the new world. Elsewhere it syncs the state once and calls the function.

    Examples
    --------
    >>> state = dg.elastic.State(net=net, trainer=trainer, epoch=0, done=0)
    >>> @dg.elastic.run
    ... def train(state):
    ...     ...                       # the training loop, state.commit() after each step
    >>> train(state)
    """

    @functools.wraps(func)
    def wrapper(state: State, *args, **kwargs):
        if not isinstance(state, State):
            raise TypeError(f"{func.__name__}'s first argument must be a "
                            f"dist_gluon.elastic.State, got {type(state).__name__}")
        session = _session(state)
        node_copy = None if session is not None else _node_copy(state)
        if session is None and node_copy is None and jobcontrol.reporter() is not None:
            jobcontrol.reporter().holds_state()     # the launcher names the flag
        if node_copy is not None:
            state.use_node_copy(node_copy)
        state.watch_stops(session is not None or node_copy is not None)
        reset = False
        while True:
            if reset:
                # a failure to join the next round ends this worker (horovod cannot be
                # initialised again after a failed hvd.init()); a new one replaces it
                session.next_round()
                state.on_reset()
            if session is not None:
                session.reporter.round_begins()
            try:
                state.sync()            # a peer lost during the sync is a fault as well
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt:
                if session is None:
                    # the commit is in the node's memory: this worker ends here, and the
                    # launcher starts it again on the new world
                    raise SystemExit(0) from None
                # committed at that very step: nothing to restore. Every rank is at this
                # commit, so the round's collectives end cleanly together now (breaking
                # them later can leave one waiting out Gloo's timeout)
                state.kv._leave()
            except Exception as error:
                if session is None or not session.lost_peer(error):
                    raise
                if state.has_commit:            # else the next sync brings rank 0's
                    state.restore()
            reset = True

    return wrapper
