"""The job-control channel between a worker and the launcher that started it.

Each worker owns one small shared-memory record (a file in the directory the launcher
names in ``DG_CONTROL_DIR``, mapped into both processes). The worker writes, at no
measurable cost per step, how many collectives it has submitted and their keys, how it
ended (an uncaught exception with its type and message, or reaching interpreter exit),
and when; the launcher reads every record to tell the rank that left first (the cause)
from ranks that failed afterwards (consequences), to spot ranks waiting in a collective
that another rank will never join, and to watch for stalls. The launcher writes one
thing back: its verdict for a rank that reached interpreter exit, which decides whether
that rank runs the backend's collective shutdown (everyone is done) or skips it (the job
has failed, and peers that would have to join it are being terminated).

A worker also dumps the Python stacks of all its threads into a file next to its record
when it receives the stacks signal (``faulthandler``; works while a thread is blocked in
C code), which the launcher requests for a stall report.

This module imports neither mxnet nor horovod: the launcher uses it too.
"""
from __future__ import annotations

import atexit
import faulthandler
import json
import mmap
import os
import signal
import struct
import sys
import threading
import time

from . import worker

ENV_DIR = "DG_CONTROL_DIR"
# The signal that asks a worker for its stacks: DG_STACKS_SIGNAL (the launcher's
# --stacks-signal), by default SIGRTMIN+7. Not SIGUSR1 or SIGUSR2: SLURM and other
# schedulers send those to warn a job, and scripts install handlers for them. glibc keeps
# real-time signals below SIGRTMIN for itself; no scheduler, MPI or library we know of
# sends SIGRTMIN+7.
DEFAULT_STACKS_SIGNAL = "SIGRTMIN+7"


def stacks_signal(environ=None) -> int:
    """The stacks signal's number, from DG_STACKS_SIGNAL: a name (``SIGUSR2``, ``USR2``,
    ``SIGRTMIN+7``) or a number. ValueError for anything else."""
    text = (environ if environ is not None else os.environ).get(
        "DG_STACKS_SIGNAL", DEFAULT_STACKS_SIGNAL).strip().upper()
    name = text if text.startswith("SIG") or text.isdigit() else "SIG" + text
    try:
        if name.isdigit():
            number = int(name)
        elif name.startswith("SIGRTMIN"):
            number = signal.SIGRTMIN + int(name[len("SIGRTMIN"):] or 0)
        else:
            number = int(getattr(signal, name))
    except (AttributeError, ValueError):
        number = -1
    if number in (signal.SIGKILL, signal.SIGSTOP, signal.SIGSEGV, signal.SIGINT,
                  signal.SIGTERM) or not 0 < number <= signal.SIGRTMAX:
        raise ValueError(f"DG_STACKS_SIGNAL={text!r} is not a signal that can ask for stacks; "
                         f"give a name such as SIGUSR2 or SIGRTMIN+7 (the default)")
    return number

_MAGIC = b"DGJC"
_VERSION = 1
# phases of a worker
ATTACHED, DEPARTING = 1, 2
# verdicts the launcher writes for a departing worker
FINALIZE, ABANDON = 1, 2

# layout: magic, version, pid, phase, verdict, launcher beat | count | departed_at |
# exception text
# | key ring (the key of collective n sits in slot n % _RING)
_HEAD = struct.Struct("<4sIiIII")       # 24 bytes
_COUNT_AT = 24                           # uint64
_DEPARTED_AT = 32                        # float64, time.time(); 0 while running
_EXCEPTION_AT = 40                       # 512 bytes, utf-8, NUL padded
_EXCEPTION_BYTES = 512
_RING_AT = _EXCEPTION_AT + _EXCEPTION_BYTES
_RING = 512
_KEY_BYTES = 64
# elastic jobs (launch/elastic.py): the launcher's request to stop at the next step
# boundary (a number, 0: none), the worker's acknowledgement (the job agreed to stop,
# dist_gluon.stop_requested() returned True), and the checkpoints it saved: how many,
# and the epoch and step of the newest
_CONTROL_AT = _RING_AT + _RING * _KEY_BYTES
_STOP_AT, _ACK_AT = _CONTROL_AT, _CONTROL_AT + 4          # uint32 each
_SAVES_AT = _CONTROL_AT + 8                                # uint64
_SAVED_EPOCH_AT, _SAVED_STEP_AT = _CONTROL_AT + 16, _CONTROL_AT + 24   # int64 each
# elastic jobs whose workers keep their processes through a re-formation
# (dist_gluon.elastic.run): the worker says it does (keeps) and when it waits for its
# next round (parked: the round it left + 1); the launcher ends the worker's round
# (abort: that round + 1, the worker then breaks its pending collectives) and hands it
# the next one (round: its number + 1, and the environment it brings as JSON)
_KEEPS_AT, _PARKED_AT = _CONTROL_AT + 32, _CONTROL_AT + 36              # uint32 each
_ABORT_AT, _ROUND_AT = _CONTROL_AT + 40, _CONTROL_AT + 44               # uint32 each
_ROUND_LEN_AT = _CONTROL_AT + 48                                        # uint32
_ROUND_DATA_AT, _ROUND_BYTES = _CONTROL_AT + 52, 8192
# workers that restart (ps-lite) but commit their state to their node's shared memory
# (dist_gluon.elastic.run, dist_gluon.elastic.nodecopy): the next round takes it from there
_NODE_COPY_AT = _ROUND_DATA_AT + _ROUND_BYTES                           # uint32
# the script holds a dist_gluon.elastic.State under dist_gluon.elastic.run in a job
# that is not elastic: the launcher says which flag recovers it in memory
_HOLDS_STATE_AT = _NODE_COPY_AT + 4                                     # uint32
RECORD_SIZE = _HOLDS_STATE_AT + 4
# stop requests with a meaning of their own (the launcher numbers its requests from 1):
# the worker got SIGTERM itself, or the launcher is ending the worker
SIGNALLED, TERMINATING = 0xFFFFFFFE, 0xFFFFFFFF
_I64 = struct.Struct("<q")
_U64 = struct.Struct("<Q")
_F64 = struct.Struct("<d")
_U32 = struct.Struct("<I")
_PHASE_AT, _VERDICT_AT, _BEAT_AT = 12, 16, 20
# A departing worker stops waiting for its verdict when its launcher has not stamped the
# record for this long (seconds of CLOCK_MONOTONIC, which every process of a host
# shares): the launcher is wedged, and the worker ends without the collective shutdown.
# DG_LAUNCHER_SILENCE (seconds) overrides it.
LAUNCHER_SILENCE = 30.0


def record_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank{rank}.rec")


def stacks_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank{rank}.stacks")


def create_record(directory: str, rank: int) -> str:
    """Launcher side: an empty record for ``rank`` (all zeros: not attached yet)."""
    path = record_path(directory, rank)
    with open(path, "wb") as f:
        f.truncate(RECORD_SIZE)
    open(stacks_path(directory, rank), "wb").close()
    return path


class Record:
    """One rank's record, mapped read-write (the worker writes progress and its end, the
    launcher writes verdicts)."""

    def __init__(self, path: str):
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), RECORD_SIZE)

    # ------------------------------------------------------------------ reading
    @property
    def attached(self) -> bool:
        return self._map[:4] == _MAGIC

    @property
    def pid(self) -> int:
        return _HEAD.unpack_from(self._map)[2]

    @property
    def phase(self) -> int:
        return _U32.unpack_from(self._map, _PHASE_AT)[0]

    @property
    def verdict(self) -> int:
        return _U32.unpack_from(self._map, _VERDICT_AT)[0]

    @property
    def count(self) -> int:
        return _U64.unpack_from(self._map, _COUNT_AT)[0]

    @property
    def departed_at(self) -> float | None:
        value = _F64.unpack_from(self._map, _DEPARTED_AT)[0]
        return value or None

    @property
    def exception(self) -> str | None:
        raw = self._map[_EXCEPTION_AT:_EXCEPTION_AT + _EXCEPTION_BYTES].split(b"\0", 1)[0]
        return raw.decode("utf-8", "replace") or None

    def key(self, n: int) -> str | None:
        """The key of collective ``n`` (1-based), if still in the ring."""
        if n < 1 or n > self.count or n <= self.count - _RING:
            return None
        at = _RING_AT + (n % _RING) * _KEY_BYTES
        return self._map[at:at + _KEY_BYTES].split(b"\0", 1)[0].decode("utf-8", "replace")

    def keys(self, last: int) -> list[str]:
        """The keys of the last ``last`` collectives still in the ring, oldest first."""
        count = self.count
        return [key for key in (self.key(n) for n in range(max(1, count - last + 1),
                                                            count + 1)) if key is not None]

    @property
    def stop_request(self) -> int:
        """The launcher's request to stop at the next step boundary (0: none)."""
        return _U32.unpack_from(self._map, _STOP_AT)[0]

    @property
    def stop_acknowledged(self) -> bool:
        """The worker agreed with every other rank to stop (and then saves and exits)."""
        return bool(_U32.unpack_from(self._map, _ACK_AT)[0])

    @property
    def saves(self) -> int:
        """How many checkpoints this worker has saved (dist_gluon.Checkpointer)."""
        return _U64.unpack_from(self._map, _SAVES_AT)[0]

    @property
    def saved_position(self) -> tuple[int, int] | None:
        """The (epoch, step) of the newest checkpoint this worker saved, or None."""
        if not self.saves:
            return None
        return (_I64.unpack_from(self._map, _SAVED_EPOCH_AT)[0],
                _I64.unpack_from(self._map, _SAVED_STEP_AT)[0])

    @property
    def keeps(self) -> bool:
        """The worker keeps its process through a re-formation (dist_gluon.elastic.run)."""
        return bool(_U32.unpack_from(self._map, _KEEPS_AT)[0])

    @property
    def node_copy(self) -> bool:
        """The worker commits its state to its node's shared memory: restarted, it
        takes the state from there (dist_gluon.elastic.run on ps-lite)."""
        return bool(_U32.unpack_from(self._map, _NODE_COPY_AT)[0])

    @property
    def holds_state(self) -> bool:
        """The worker runs dist_gluon.elastic.run with a State, in a job that is not
        elastic (so a failure restarts it from its script's start)."""
        return bool(_U32.unpack_from(self._map, _HOLDS_STATE_AT)[0])

    @property
    def parked(self) -> int | None:
        """The round the worker left and now waits after (between rounds), or None."""
        value = _U32.unpack_from(self._map, _PARKED_AT)[0]
        return value - 1 if value else None

    @property
    def aborted(self) -> int | None:
        """The last round the launcher ended for this worker, or None."""
        value = _U32.unpack_from(self._map, _ABORT_AT)[0]
        return value - 1 if value else None

    def next_round(self) -> tuple[int, dict] | None:
        """The round the launcher handed this worker: (its number, the environment
        variables it sets), or None."""
        number = _U32.unpack_from(self._map, _ROUND_AT)[0]
        if not number:
            return None
        length = _U32.unpack_from(self._map, _ROUND_LEN_AT)[0]
        data = bytes(self._map[_ROUND_DATA_AT:_ROUND_DATA_AT + length])
        return number - 1, json.loads(data.decode("utf-8"))

    def snapshot(self) -> dict:
        """Everything a launcher reports about this rank, as plain values."""
        count = self.count
        return {"attached": self.attached, "pid": self.pid, "phase": self.phase,
                "count": count, "departed_at": self.departed_at,
                "exception": self.exception,
                "keys": {n: self.key(n) for n in range(max(1, count - _RING + 1), count + 1)}}

    # ------------------------------------------------------------------ writing
    def set_verdict(self, verdict: int) -> None:
        _U32.pack_into(self._map, _VERDICT_AT, verdict)

    def request_stop(self, number: int) -> None:
        """Launcher side: ask the worker to stop at its next step boundary."""
        _U32.pack_into(self._map, _STOP_AT, number)

    def end_round(self, number: int) -> None:
        """Launcher side: round ``number`` is over for a worker that keeps its process;
        it breaks the collectives still pending and waits for its next round."""
        _U32.pack_into(self._map, _ABORT_AT, number + 1)

    def hand_round(self, number: int, environ: dict[str, str]) -> None:
        """Launcher side: the worker's next round, ``number``, with the environment
        variables that place it there (rank, world, rendezvous). Its stop request and
        acknowledgement of the round before are cleared first."""
        data = json.dumps(environ).encode("utf-8")
        if len(data) > _ROUND_BYTES:
            raise ValueError(f"a round's environment takes {len(data)} bytes, more than "
                             f"the record's {_ROUND_BYTES}")
        _U32.pack_into(self._map, _STOP_AT, 0)
        _U32.pack_into(self._map, _ACK_AT, 0)
        if _U32.unpack_from(self._map, _PARKED_AT)[0] == 0:
            # a worker that did not leave the round before by itself (stopped, or stuck
            # outside a collective when it ended) counts as parked, after the round
            # before this one, until it enters this one (Reporter.entered_round)
            _U32.pack_into(self._map, _PARKED_AT, number)
        self._map[_ROUND_DATA_AT:_ROUND_DATA_AT + len(data)] = data
        _U32.pack_into(self._map, _ROUND_LEN_AT, len(data))
        _U32.pack_into(self._map, _ROUND_AT, number + 1)

    def _keep(self) -> None:
        _U32.pack_into(self._map, _KEEPS_AT, 1)

    def _commit_to_node(self) -> None:
        _U32.pack_into(self._map, _NODE_COPY_AT, 1)

    def _park(self, number: int | None) -> None:
        _U32.pack_into(self._map, _PARKED_AT, 0 if number is None else number + 1)

    def _new_round(self) -> None:
        """The worker entered its next round: its collectives count from 0 again, as
        every new process of that round does."""
        _U64.pack_into(self._map, _COUNT_AT, 0)

    def _acknowledge_stop(self) -> None:
        _U32.pack_into(self._map, _ACK_AT, 1)

    def _saved(self, epoch: int, step: int) -> None:
        # the position first: a launcher that sees the new count reads the new position
        _I64.pack_into(self._map, _SAVED_EPOCH_AT, epoch)
        _I64.pack_into(self._map, _SAVED_STEP_AT, step)
        _U64.pack_into(self._map, _SAVES_AT, self.saves + 1)

    def stamp(self, now: float) -> None:
        """Launcher side: it is alive and supervising (``time.monotonic()``)."""
        _U32.pack_into(self._map, _BEAT_AT, int(now) + 1)

    @property
    def launcher_beat(self) -> float | None:
        """When the launcher last stamped the record (monotonic seconds), or None."""
        value = _U32.unpack_from(self._map, _BEAT_AT)[0]
        return float(value - 1) if value else None

    def _attach(self, pid: int) -> None:
        _HEAD.pack_into(self._map, 0, _MAGIC, _VERSION, pid, ATTACHED, 0, 0)

    def _submit(self, key: str) -> None:
        n = _U64.unpack_from(self._map, _COUNT_AT)[0] + 1
        at = _RING_AT + (n % _RING) * _KEY_BYTES
        self._map[at:at + _KEY_BYTES] = key.encode("utf-8", "replace")[:_KEY_BYTES - 1] \
            .ljust(_KEY_BYTES, b"\0")
        _U64.pack_into(self._map, _COUNT_AT, n)

    def _depart(self, when: float) -> None:
        if not self.departed_at:
            _F64.pack_into(self._map, _DEPARTED_AT, when)
        _U32.pack_into(self._map, _PHASE_AT, DEPARTING)

    def _set_exception(self, text: str, when: float) -> None:
        data = text.encode("utf-8", "replace")[:_EXCEPTION_BYTES - 1]
        self._map[_EXCEPTION_AT:_EXCEPTION_AT + _EXCEPTION_BYTES] = \
            data.ljust(_EXCEPTION_BYTES, b"\0")
        if not self.departed_at:
            _F64.pack_into(self._map, _DEPARTED_AT, when)


def _ends_the_process(handler) -> bool:
    """Whether a SIGTERM handler is coverage.py's (``[run] sigterm = true``): it writes
    the measured data and ends the process with the default action."""
    return callable(handler) and \
        getattr(handler, "__module__", "").split(".")[0] == "coverage"


# signals of a fault in the process's own code (C or Python's)
FAULT_SIGNALS = ("SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT")


def _die_at_faults() -> None:
    """Make a fault end this worker at once, killed by its signal, after Python's stacks
    of every thread on stderr (``faulthandler``).

    MXNet's own handler prints "Segmentation fault" and calls ``exit()`` inside the
    handler, which runs the process's destructors from a broken state and can wait
    forever: a horovod worker whose background loop crashed when node 0 was killed
    stayed alive without a thread left to reach the re-formed round, and the job's
    survivors never trained again (bench-cluster part 7, 3 of 3 and 1 in 7 of
    tests/test_elastic_memory.py's job). Dead, it is replaced like any lost worker."""
    for name in FAULT_SIGNALS:
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    faulthandler.enable(file=sys.stderr, all_threads=True)


class Reporter:
    """The worker side: reports progress and the end of this process to its launcher."""

    def __init__(self, record: Record, stacks_file: str):
        self._record = record
        # collectives are also submitted from MXNet's autograd threads (SyncBatchNorm's
        # backward): a lost increment would make a rank look as if it left early
        self._lock = threading.Lock()
        record._attach(os.getpid())
        _die_at_faults()
        # kept open for the process's lifetime: faulthandler writes to its descriptor
        self._stacks = open(stacks_file, "a")
        signum = stacks_signal()
        # a handler the script installed for this signal keeps working: it runs after
        # the stacks are written (and a handler installed later simply replaces ours)
        previous = signal.getsignal(signum)
        faulthandler.register(signum, file=self._stacks, all_threads=True,
                              chain=callable(previous))
        # elastic jobs take over SIGTERM unless the script has a handler of its own; the
        # handler of a tool that only ends the process after writing its data (coverage's
        # sigterm option) is what ending the worker then runs
        self._sigterm_end = signal.getsignal(signal.SIGTERM)
        if worker.context().elastic and \
                (self._sigterm_end == signal.SIG_DFL
                 or _ends_the_process(self._sigterm_end)) and \
                threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)
        self._previous_hook = sys.excepthook
        sys.excepthook = self._excepthook
        self._previous_thread_hook = threading.excepthook
        threading.excepthook = self._thread_excepthook
        atexit.register(self.depart)

    def submitted(self, key: str) -> None:
        """A collective under ``key`` was submitted (called by the backends)."""
        with self._lock:
            self._record._submit(key)

    def stop_request(self) -> int:
        """The launcher's pending request to stop at the next step boundary (0: none)."""
        return self._record.stop_request

    def stop_acknowledged(self) -> None:
        """Every rank agreed to stop here: the launcher re-forms the job once they exit."""
        self._record._acknowledge_stop()

    def keep_process(self) -> None:
        """This worker keeps its process through a re-formation (dist_gluon.elastic.run):
        the launcher ends its round and hands it the next instead of ending it."""
        self._record._keep()

    def commit_to_node(self) -> None:
        """This worker commits its state to its node's shared memory and takes it from
        there when it is started again (dist_gluon.elastic.run on ps-lite)."""
        self._record._commit_to_node()

    def holds_state(self) -> None:
        """This worker runs dist_gluon.elastic.run with a State in a job that is not
        elastic: the launcher tells the user how to recover it in memory."""
        _U32.pack_into(self._record._map, _HOLDS_STATE_AT, 1)

    def park(self, number: int | None) -> None:
        """The worker left round ``number`` and waits for its next (None: it is in a
        round again)."""
        self._record._park(number)

    def round_aborted(self) -> int | None:
        """The last round the launcher ended for this worker, or None."""
        return self._record.aborted

    def next_round(self) -> tuple[int, dict] | None:
        """The newest round the launcher handed this worker, or None."""
        return self._record.next_round()

    def entered_round(self) -> None:
        """The worker joined its next round's collectives."""
        with self._lock:
            self._record._new_round()
        self._record._park(None)

    def round_begins(self) -> None:
        """Every rank of the round is about to make the round's first collective in
        common (the State's sync): its collectives count from here, in a worker kept
        from the round before and in a new one alike. A new worker has also counted
        what its script ran before (the trainer's first broadcast...), which a kept one
        does not run again: without this the launcher would compare counts that are
        not of the same collectives, and see two ranks waiting in different
        collectives as ranks at the same one."""
        with self._lock:
            self._record._new_round()

    def checkpoint_saved(self, epoch: int, step: int) -> None:
        """A checkpoint of (epoch, step) is on disk (called by dist_gluon.Checkpointer)."""
        self._record._saved(epoch, step)

    def _on_sigterm(self, signum, frame) -> None:
        """Elastic jobs: SIGTERM to a worker (SLURM and cloud preemption signal every
        process) asks the job to stop at the next step boundary, as a preemption of its
        node does; a second one, or the launcher ending the worker, ends it at once."""
        if self._record.stop_request in (SIGNALLED, TERMINATING):
            signal.signal(signal.SIGTERM, self._sigterm_end)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        self._record.request_stop(SIGNALLED)
        print("dist_gluon: SIGTERM: this worker stops at its next step boundary, after "
              "every rank agrees (dist_gluon.stop_requested()); a second SIGTERM ends it "
              "now", file=sys.stderr, flush=True)

    def depart(self) -> None:
        """The script has ended (interpreter exit): record when, once."""
        self._record._depart(time.time())

    def wait_for_verdict(self, poll: float = 0.01) -> int:
        """Mark this rank as departing and wait until the launcher decides: FINALIZE when
        every rank has finished its script (run the collective shutdown), ABANDON when
        the job has failed (skip it). The launcher always decides; if it dies, so does
        this process (the launcher sets PDEATHSIG). If the launcher stops stamping the
        record for LAUNCHER_SILENCE seconds (it is wedged), the wait ends as ABANDON."""
        silence = float(os.environ.get("DG_LAUNCHER_SILENCE", LAUNCHER_SILENCE))
        self.depart()
        while True:
            verdict = self._record.verdict
            if verdict:
                return verdict
            beat = self._record.launcher_beat
            if beat is not None and time.monotonic() - beat > silence + 1:
                print(f"dist_gluon: the launcher has not answered for {silence:g} s; this "
                      "worker ends without the collective shutdown",
                      file=sys.stderr, flush=True)
                return ABANDON
            time.sleep(poll)

    def failed(self, text: str) -> None:
        """Record why this process is about to end abnormally (e.g. a watchdog that
        ends it with os._exit), so that the launcher can name the reason."""
        self._record._set_exception(text, time.time())

    def _excepthook(self, exc_type, exc, tb):
        text = exc_type.__name__
        message = str(exc).strip()
        if message:
            text += ": " + message.splitlines()[0]
        hint = _concurrent_block_hint(exc_type, tb)
        if hint:
            text += " (" + hint + ")"
        self._record._set_exception(text, time.time())
        self._previous_hook(exc_type, exc, tb)
        if hint:
            print(f"dist_gluon: {hint}", file=sys.stderr, flush=True)


    def _thread_excepthook(self, args) -> None:
        """An exception that ends one of the script's threads ends the worker, as one in
        the main thread does, and the launcher names it: the rank would otherwise go on
        without the thread's work and leave its peers waiting for it."""
        if args.exc_type is SystemExit:
            return
        name = args.thread.name if args.thread is not None else "a thread"
        text = f"{args.exc_type.__name__} in thread {name!r}"
        message = str(args.exc_value).strip() if args.exc_value is not None else ""
        if message:
            text += ": " + message.splitlines()[0]
        self._record._set_exception(text, time.time())
        self._previous_thread_hook(args)
        print(f"dist_gluon: an uncaught exception ended thread {name!r}; this worker ends "
              "with status 1, as for one in the main thread", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)


def _concurrent_block_hint(exc_type, tb) -> str | None:
    """Explain gluon's one cryptic thread race: a Block's name scope entered by two
    threads at once (a hybridized block's first call builds its graph inside it, and
    ``transforms.Compose`` hybridizes its HybridBlocks), which ends in an
    AttributeError from ``_BlockScope.__exit__``."""
    if exc_type is not AttributeError:
        return None
    last = None
    while tb is not None:
        last, tb = tb, tb.tb_next
    code = last.tb_frame.f_code if last is not None else None
    if code is None or code.co_name != "__exit__" \
            or not code.co_filename.endswith(os.path.join("gluon", "block.py")):
        return None
    return ("a gluon Block was called from two threads at once before its cached graph "
            "existed, e.g. a hybridized transform in DataLoader(thread_pool=True); call "
            "transform.hybridize(False), or call the block once before the threads start")


_reporter: Reporter | None = None
_attached = False


def reporter() -> Reporter | None:
    """This process's reporter, or None when no launcher listens (no DG_CONTROL_DIR)."""
    global _reporter, _attached
    if not _attached:
        _attached = True
        place = worker.context()
        directory, rank = place.control_dir, place.rank
        if directory and place.placed and os.path.exists(record_path(directory, rank)):
            _reporter = Reporter(Record(record_path(directory, rank)),
                                 stacks_path(directory, rank))
    return _reporter
