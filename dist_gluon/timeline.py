"""Where a worker's time goes: the one reporter the trainer, the averager and the codecs
call, writing what the launcher turns into the job's report and timeline.

Two levels, chosen by the launcher (``dist_gluon.launch``) through the environment:

- **steps** (under the launcher unless ``--report off``): one small binary record per
  training step (:data:`STEP`) appended to ``<DG_OBSERVE_DIR>/rank<R>.r<restart>.steps``:
  when the step began and ended on the Python thread, when every rank had arrived
  (the step's header sum came back), when this rank's backward had finished and when
  its last gradient sum had arrived (both on MXNet's engine, seen by a helper thread
  that waits for each array in turn, so the training thread never does), the time spent
  waiting for data (:func:`data`), the process's CPU time, the samples and the bytes
  sent. The launcher reads them for the per-rank report (straggler, bound).
- **timeline** (``--timeline FILE`` or ``DG_TIMELINE``): the same, plus Chrome trace
  events (``<DG_OBSERVE_DIR>/rank<R>.r<restart>.trace``, one JSON object a line):
  spans on the Python thread (data, step, waiting for the other ranks, codecs, the
  optimizer update) and on an "engine" track (compute up to the end of backward, and
  each collective from its submission until its result was ready). The launcher
  merges every rank's file with its own events into FILE.

Off (no DG_OBSERVE_DIR, e.g. a script run without the launcher) every call returns at
its first test. Times are ``time.monotonic()`` (CLOCK_MONOTONIC: one clock for every
process of a host), in seconds; trace events are in microseconds, as Chrome's format.

This module imports neither mxnet nor horovod (arrays are only asked to
``wait_to_read``), so the launcher may import it too.
"""
from __future__ import annotations

import atexit
import contextlib
import glob
import json
import math
import os
import queue
import struct
import threading
import time
from collections.abc import Iterable, Iterator

from . import worker

ENV_DIR = "DG_OBSERVE_DIR"
ENV_LEVEL = "DG_OBSERVE"          # "steps" or "timeline"
# step index, t_start, t_header, t_end, t_ready, t_sums, data seconds, CPU seconds,
# samples, bytes sent (t_* in time.monotonic() seconds; NaN where not seen)
STEP = struct.Struct("<q9d")
_NAN = float("nan")
# seconds a process at exit gives the helper thread to record the steps in flight
CLOSE_WAIT = 1.0


def steps_path(directory: str, rank: int, restart: int) -> str:
    return os.path.join(directory, f"rank{rank}.r{restart}.steps")


def trace_path(directory: str, rank: int, restart: int) -> str:
    return os.path.join(directory, f"rank{rank}.r{restart}.trace")


def read_steps(path: str, offset: int = 0) -> tuple[list[tuple], int]:
    """The step records of ``path`` from byte ``offset`` on, and the offset after the
    last whole record (for the next read)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return [], offset
    whole = len(data) - len(data) % STEP.size
    return list(STEP.iter_unpack(data[:whole])), offset + whole


def read_lines(path: str, offset: int = 0, limit: int = 1 << 62) -> tuple[list[str], int]:
    """The whole lines of ``path`` from byte ``offset`` on (at most about ``limit``
    bytes of them, at least one line), and the offset after the last one read: a line
    the writer has not finished yet is left for the next read."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(limit)
            end = data.rfind(b"\n")
            if end < 0 and len(data) == limit:
                data += f.readline()        # one line longer than the limit
                end = data.rfind(b"\n")
    except OSError:
        return [], offset
    if end < 0:
        return [], offset
    text = data[:end].decode("utf-8", "replace")
    return [line for line in text.split("\n") if line], offset + end + 1


def _finite(x: float) -> bool:
    return x == x and not math.isinf(x)


def breakdown(records: dict[int, list[tuple]],
              asynchronous: bool = False) -> dict[int, list[tuple]]:
    """Each rank's steps split into the four shares: rank -> list of ``(step, end,
    period, data, compute, comm, wait)`` in seconds (``end`` on the records' clock),
    for every step whose previous step the rank also recorded. ``asynchronous``
    (dist_async): ranks never wait for one another, and their steps of the same
    number are unrelated; communication runs from this rank's readiness. A step with
    no sum (Local SGD, DiLoCo between two averagings) waits for no one either."""
    ready_by_step: dict[int, float] = {}
    for rows in records.values():
        for row in rows:
            index, start, _header, _end, ready, sums = row[:6]
            if not _finite(sums):
                continue        # a step without a sum (Local SGD's) waits for no one
            mine = max(start, ready) if _finite(ready) else start
            ready_by_step[index] = max(ready_by_step.get(index, -math.inf), mine)
    split = {}
    for rank, rows in records.items():
        previous = {row[0]: row for row in rows}
        steps = []
        for row in rows:
            index, start, _header, end, ready, sums, data = row[:7]
            before = previous.get(index - 1)
            period = end - before[3] if before is not None else 0.0
            if period <= 0:
                continue
            mine = max(start, ready) if _finite(ready) else start
            # ranks wait for one another only in a step that sums: Local SGD's and
            # DiLoCo's steps between two averagings are each rank's own
            last = mine if asynchronous or not _finite(sums) \
                else ready_by_step.get(index, mine)
            wait = min(period, max(0.0, last - mine))
            comm = min(period - wait, max(0.0, sums - last)) if _finite(sums) else 0.0
            data = min(period - wait - comm, max(0.0, data))
            steps.append((index, end, period, data, period - wait - comm - data, comm,
                          wait))
        split[rank] = steps
    return split


class _Step:
    """The step in progress: noted by the training thread, completed by the helper."""

    __slots__ = ("index", "start", "header", "data", "bytes", "ready", "sums", "done",
                 "inputs", "started", "pending")

    def __init__(self, index: int, start: float, data: float):
        self.index, self.start, self.data = index, start, data
        self.header = _NAN
        self.bytes = 0
        self.ready = self.sums = _NAN     # seen by the helper thread
        # timeline only: (name, key, submitted, finished) of each collective, from the
        # helper; (key, marker) of each collective's input, and key -> when that input
        # was ready (the collective could start), from the inputs thread; the threads
        # still busy with the step (the last one writes its collectives)
        self.done: list = []
        self.inputs: list = []
        self.started: dict = {}
        self.pending = 2


class _Reporter:
    """The process's reporter: the training thread notes what it submits, a helper
    thread waits for each array in submission order (so it notices when the engine is
    done with it) and writes."""

    def __init__(self, directory: str, place: worker.WorkerContext, events: bool):
        self.events = events
        # the worker's place, read at each step: a survivor of an in-process
        # re-formation goes on in the new round's files, under its new rank
        self._place = place
        self.rank, self.restart = place.rank, place.restart
        self._directory = directory
        self.steps = 0                  # the round's steps (every rank's count from 1)
        self.step: _Step | None = None
        self._data = 0.0                # waiting for data since the last step ended
        self._last_end = None
        self._last = None               # the step's last collective (steps level)
        self._fd, self._trace = self._open(self.rank, self.restart)
        self._buffer: list = []         # trace events: dicts, or lines made already
        self._quoted: dict[str, str] = {}
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, daemon=True,
                                        name="dist_gluon.timeline")
        self._thread.start()
        # the timeline's second helper: when each collective's input was ready
        self._inputs: queue.SimpleQueue = queue.SimpleQueue()
        self._inputs_thread = threading.Thread(target=self._work_inputs, daemon=True,
                                               name="dist_gluon.timeline inputs")
        if events:
            self._inputs_thread.start()
        # registered after mxnet's own (imported before any step): runs first, while
        # the engine still answers
        atexit.register(self.close)

    def _open(self, rank: int, restart: int):
        fd = os.open(steps_path(self._directory, rank, restart),
                     os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        trace = open(trace_path(self._directory, rank, restart), "a") if self.events \
            else None
        return fd, trace

    # ------------------------------------------------------------ training thread
    def begin_step(self, first_grad) -> None:
        place = self._place
        if (place.rank, place.restart) != (self.rank, self.restart):
            self._new_round(place.rank, place.restart)
        self.steps += 1
        step = self.step = _Step(self.steps, time.monotonic(), self._data)
        self._data = 0.0
        marker = None if first_grad is None else _marker(first_grad)
        if marker is not None:
            # queued before the gradient's sum overwrites it: ready once the backward
            # wrote the gradient (the first layer's, which it writes last)
            self._jobs.put((self._backward_ended, step, marker))

    def collective(self, key: str, array, nbytes: int, name: str, ready) -> None:
        step = self.step
        step.bytes += nbytes
        if not self.events:
            self._last = array
            return
        marker = _marker(array)
        if marker is not None:
            self._jobs.put((self._summed, step, key, time.monotonic(), marker, name))
            if ready is not None:
                step.inputs.append((key, ready))

    def end_step(self, samples: float, at: tuple[float, float] | None = None) -> None:
        step, self.step = self.step, None
        if step is None:
            return
        # a step that ended ``at`` (its time and CPU time) some calls ago: its last sum
        # can no longer be told apart from later writes to the same array
        marker = None if self._last is None or at is not None else _marker(self._last)
        self._last = None
        if marker is not None:
            # the last sum submitted (the lowest priority) arrives last
            self._jobs.put((self._summed, step, "", 0.0, marker, ""))
        end, cpu = at or (time.monotonic(), time.process_time())
        self._jobs.put((self._ended, step, end, cpu, samples, self._last_end))
        self._last_end = end
        if self.events:
            self._inputs.put((step, step.inputs, True))
            step.inputs = []

    def submitted(self) -> None:
        step = self.step
        if self.events and step is not None and step.inputs:
            self._inputs.put((step, step.inputs, False))
            step.inputs = []

    def add_data_wait(self, start: float, end: float) -> None:
        self._data += end - start
        if self.events:
            self.event({"name": "data", "cat": "data", "ph": "X", "tid": 0,
                        "ts": _us(start), "dur": _us(end - start)})

    def event(self, event: dict) -> None:
        """Queue one trace event (made into JSON by the helper thread when it writes)."""
        event["pid"] = self.rank
        with self._lock:
            self._buffer.append(event)

    def _new_round(self, rank: int, restart: int) -> None:
        """The job re-formed around this process: the steps from here on are the new
        round's, counted from 1 as its new workers count theirs, in its files. The
        helper switches files once it has written the steps before."""
        self.rank, self.restart, self.steps = rank, restart, 0
        self._last_end = self._last = None
        self._jobs.put((self._switch_files, rank, restart))

    def _switch_files(self, rank: int, restart: int) -> None:
        self._flush()
        with self._write_lock:
            os.close(self._fd)
            if self._trace is not None:
                self._trace.close()
            self._fd, self._trace = self._open(rank, restart)

    # ------------------------------------------------------------ helper thread
    def _work(self) -> None:
        last_flush = time.monotonic()
        while True:
            job = self._jobs.get()
            if job is None:
                break
            try:
                job[0](*job[1:])
            except Exception:       # an engine error belongs to the training thread
                pass
            if self._trace is not None and time.monotonic() - last_flush > 1.0:
                self._flush()
                last_flush = time.monotonic()
        self._flush()

    def _work_inputs(self) -> None:
        """When each collective's input was ready. The backward writes the gradients
        in about the reverse of the order they are submitted in (the last layer's
        first), and a wait sees an input no earlier than the one waited for before:
        so the inputs are waited for in reverse, once the training thread has
        submitted the step's collectives (:func:`submitted`, or the step's end)."""
        while True:
            job = self._inputs.get()
            if job is None:
                break
            step, inputs, final = job
            try:
                for key, marker in reversed(inputs):
                    marker.wait_to_read()
                    step.started[key] = time.monotonic()
            except Exception:       # an engine error belongs to the training thread
                pass
            if final:
                self._step_seen(step)

    def _step_seen(self, step: _Step) -> None:
        """One of the two helpers is done with the step; the last writes its
        collectives."""
        with self._lock:
            step.pending -= 1
            last = step.pending == 0
        if last:
            self._collective_events(step)

    @staticmethod
    def _backward_ended(step: _Step, marker) -> None:
        marker.wait_to_read()
        step.ready = time.monotonic()

    def _summed(self, step: _Step, key: str, submitted: float, array, name: str) -> None:
        array.wait_to_read()
        step.sums = time.monotonic()
        if key:
            step.done.append((name, key, submitted, step.sums))

    def _ended(self, step: _Step, end: float, cpu: float, samples: float,
               previous_end: float | None) -> None:
        os.write(self._fd, STEP.pack(step.index, step.start, step.header, end, step.ready,
                                     step.sums, step.data, cpu, samples, step.bytes))
        if not self.events:
            return
        args = {"step": step.index}
        self.event({"name": "step", "cat": "step", "ph": "X", "tid": 0, "args": args,
                    "ts": _us(step.start), "dur": _us(end - step.start)})
        if previous_end is not None:
            self.event({"name": "forward/backward", "cat": "compute", "ph": "X", "tid": 0,
                        "args": args, "ts": _us(previous_end + step.data),
                        "dur": _us(max(0.0, step.start - previous_end - step.data))})
        if step.header == step.header:
            self.event({"name": "wait for other ranks", "cat": "wait", "ph": "X",
                        "tid": 0, "args": args, "ts": _us(step.start),
                        "dur": _us(step.header - step.start)})
        if step.ready == step.ready and previous_end is not None:
            # from the batch's arrival: the engine may still run the last step's
            # update then, but cannot have started this forward before it
            begin = previous_end + step.data
            self.event({"name": "compute (to backward's end)", "cat": "compute",
                        "ph": "X", "tid": 1, "args": args, "ts": _us(begin),
                        "dur": _us(max(0.0, step.ready - begin))})
        self._step_seen(step)

    def _collective_events(self, step: _Step) -> None:
        lines = []
        for name, key, submitted, finished in step.done:
            # async events (b/e): sums overlap one another, each gets its own row; the
            # part "running" (its input was ready) nested in it. Made here as text: a
            # ResNet's hundred sums a step through json.dumps cost more CPU than the
            # rest of the timeline
            quoted = self._quoted.get(key) or self._quoted.setdefault(key, json.dumps(key)[1:-1])
            ident = (f'"cat":"collective","pid":{self.rank},"tid":2,'
                     f'"id":"{self.rank}.{step.index}.{quoted}"')
            lines.append(f'{{"name":"{name} {quoted}",{ident},"ph":"b",'
                         f'"ts":{_us(submitted)},"args":{{"step":{step.index},'
                         f'"key":"{quoted}"}}}}')
            started = step.started.get(key)
            if started is not None:
                started = min(max(started, submitted), finished)
                lines.append(f'{{"name":"running",{ident},"ph":"b","ts":{_us(started)}}}')
                lines.append(f'{{"name":"running",{ident},"ph":"e","ts":{_us(finished)}}}')
            lines.append(f'{{"name":"{name} {quoted}",{ident},"ph":"e",'
                         f'"ts":{_us(finished)}}}')
        with self._lock:
            self._buffer.extend(lines)

    def _flush(self) -> None:
        with self._write_lock:      # the helper, or close() at exit
            with self._lock:
                events, self._buffer = self._buffer, []
            if events and self._trace is not None:
                self._trace.write("\n".join(
                    e if isinstance(e, str) else json.dumps(e, separators=(",", ":"))
                    for e in events) + "\n")
                self._trace.flush()

    def close(self) -> None:
        """At exit: let the helper finish what the engine has done (briefly: after a
        failure it may wait for a sum that never comes, and the process must not
        linger), then write the trace events made so far."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._inputs.put(None)
            self._thread.join(timeout=CLOSE_WAIT)
            if self._inputs_thread.ident is not None:   # started only with a timeline
                self._inputs_thread.join(timeout=CLOSE_WAIT / 4)
        self._flush()


def _marker(array):
    """A small copy of ``array`` (its first row), queued on the engine now: it is
    ready when every write queued to ``array`` so far is done, and nothing writes it
    again (a wait on ``array`` itself would also wait for writes queued after this
    moment, e.g. the next step's backward, and fall behind for good). One operator
    call: 24 us of the training thread's CPU, where a reshape, a slice and a copy
    took 60 us (AMD EPYC)."""
    if array.stype != "default" or not array.size:
        return None
    return array.slice_axis(axis=0, begin=0, end=1)


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 1)


_reporter: _Reporter | None = None
_started = False


def _get() -> _Reporter | None:
    global _reporter, _started
    if not _started:
        _started = True
        place = worker.context()
        directory = place.observe_dir
        if directory and os.path.isdir(directory):
            _reporter = _Reporter(directory, place, place.observe == "timeline")
    return _reporter


# ---------------------------------------------------------------- the API callers use
def begin_step(first_grad=None) -> None:
    """The training thread entered a step; ``first_grad()`` gives the gradient the
    backward writes last (the first trainable parameter's), before anything overwrites
    it (called only when the step is observed)."""
    reporter = _get()
    if reporter is not None:
        reporter.begin_step(None if first_grad is None else first_grad())


def submitted() -> None:
    """The training thread has submitted the step's collectives and is about to wait
    (for the step's header): the timeline's helper starts watching their inputs."""
    reporter = _reporter
    if reporter is not None:
        reporter.submitted()


def header_arrived() -> None:
    """Every rank has arrived: the step's header sum came back."""
    reporter = _reporter
    if reporter is not None and reporter.step is not None:
        reporter.step.header = time.monotonic()


def input_marker(array):
    """Called just before a collective on ``array`` is submitted (with the timeline
    only; else None): a one-element copy of it that is ready once what the collective
    reads is written (the backward wrote the gradient), for :func:`collective`'s
    ``ready``."""
    reporter = _reporter
    if reporter is None or not reporter.events or reporter.step is None:
        return None
    return _marker(array)


def collective(key: str, array, nbytes: int = 0, name: str = "sum", ready=None) -> None:
    """A collective under ``key`` was submitted; ``array`` holds its result. ``name``
    says what it does in the timeline (a sum; dist_async's "push, pull"); ``ready``:
    :func:`input_marker` of its input, taken just before it was submitted."""
    reporter = _reporter
    if reporter is not None and reporter.step is not None:
        reporter.collective(key, array, nbytes, name, ready)


def end_step(samples: float = 0.0, at: tuple[float, float] | None = None) -> None:
    """The training thread leaves the step (its update is queued on the engine); or
    left it ``at`` (``time.monotonic()``, ``time.process_time()``) earlier."""
    reporter = _reporter
    if reporter is not None:
        reporter.end_step(samples, at)


class UpdateSteps:
    """The steps of an optimizer that is called once per parameter (the Module API's
    updater calls ``update(index, ...)`` for each, or for lists of them), for the
    job's report and timeline: a step begins with the first call, or a call whose
    index this step has seen already, and ends with as many calls as the step before
    made (the first step's end is the last call before the second begins).

    The owner calls :meth:`enter` before it sums the call's gradients and :meth:`leave`
    after the update is queued.
    """

    __slots__ = ("_seen", "_calls", "_per_step", "_last")

    def __init__(self):
        self._seen: set = set()
        self._calls = 0
        self._per_step: int | None = None
        self._last: tuple[float, float] | None = None     # the last call's end, CPU

    def enter(self, index, grad, samples: float) -> None:
        if _get() is None:
            return
        first = index[0] if isinstance(index, (list, tuple)) else index
        if self._calls and first not in self._seen:
            self._seen.add(first)
            return
        if self._calls:
            if _reporter.step is not None:      # the first step, or a shorter one
                end_step(samples, self._last)
            self._per_step = self._calls
        self._seen.clear()
        self._seen.add(first)
        self._calls = 0
        begin_step(lambda: grad[0] if isinstance(grad, (list, tuple)) else grad)

    def leave(self, samples: float) -> None:
        if _reporter is None:
            return
        self._calls += 1
        self._last = (time.monotonic(), time.process_time())
        if self._calls == self._per_step:
            end_step(samples)


class _Span:
    __slots__ = ("name", "cat", "args", "start")

    def __init__(self, name: str, cat: str, args: dict):
        self.name, self.cat, self.args = name, cat, args

    def __enter__(self):
        self.start = time.monotonic()
        return self

    def __exit__(self, *exc):
        end = time.monotonic()
        _reporter.event({"name": self.name, "cat": self.cat, "ph": "X", "tid": 0,
                         "ts": _us(self.start), "dur": _us(end - self.start),
                         **({"args": self.args} if self.args else {})})
        return False


def span(name: str, cat: str = "python", **args):
    """A context manager that records its block as a span on this rank's Python track
    (with the timeline only; otherwise a shared no-op)."""
    reporter = _reporter
    if reporter is None or not reporter.events:
        return contextlib.nullcontext()
    return _Span(name, cat, args)


def instant(name: str, cat: str = "python", **args) -> None:
    """A moment on this rank's Python track (with the timeline only)."""
    reporter = _reporter
    if reporter is not None and reporter.events:
        reporter.event({"name": name, "cat": cat, "ph": "i", "s": "t", "tid": 0,
                        "ts": _us(time.monotonic()), **({"args": args} if args else {})})


def data(iterable: Iterable) -> Iterator:
    """Iterate over ``iterable`` (a DataLoader, an ``mx.io`` iterator...) and count the
    time each item took to arrive as waiting for data, in the job's report and
    timeline. Without the launcher it is the iterable's own iteration.

    Examples
    --------
    >>> for data, label in dist_gluon.timeline.data(train_loader):
    ...     ...
    """
    reporter = _get()
    if reporter is None:
        yield from iterable
        return
    iterator = iter(iterable)
    while True:
        start = time.monotonic()
        try:
            item = next(iterator)
        except StopIteration:
            return
        reporter.add_data_wait(start, time.monotonic())
        yield item


def expect_steps(total: int) -> None:
    """Tell the launcher how many steps the job makes, so that its progress line (on a
    terminal) shows the time left. Rank 0's call counts; without the launcher it does
    nothing."""
    place = worker.context()
    directory = place.observe_dir
    if not directory or place.rank != 0 or not os.path.isdir(directory):
        return
    path = os.path.join(directory, "total")
    with open(path + ".tmp", "w") as f:
        f.write(str(int(total)))
    os.replace(path + ".tmp", path)


def expected_steps(directory: str) -> int | None:
    """Launcher side: the number of steps rank 0 announced (:func:`expect_steps`)."""
    try:
        with open(os.path.join(directory, "total")) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def step_breakdown() -> dict[int, list[tuple]]:
    """Every rank's steps so far in this run, split as the launcher's report splits
    them: rank -> list of ``(step, seconds since the first step, period, data, compute,
    communication, waiting for others)``, in seconds. The ranks' records are read
    from the launcher's directory: on node 0 every rank's (the other nodes' as their
    launchers sent them, placed on this host's clock), on another node this host's;
    empty without the launcher (or with ``--report off``). For a plot of each rank's
    step time."""
    place = worker.context()
    directory = place.observe_dir
    if not directory or not os.path.isdir(directory):
        return {}
    restart = place.restart
    records = {}
    for path in glob.glob(os.path.join(directory, f"rank*.r{restart}.steps")) + \
            glob.glob(os.path.join(directory, "remote", "*", f"rank*.r{restart}.steps")):
        rows, _ = read_steps(path)
        if rows:
            records[int(os.path.basename(path).split(".")[0][len("rank"):])] = rows
    split = breakdown(records, place.backend == "dist_async")
    origin = min((s[0][1] for s in split.values() if s), default=0.0)
    return {rank: [(s[0], s[1] - origin, *s[2:]) for s in steps]
            for rank, steps in sorted(split.items())}


def save_step_plot(path: str) -> bool:
    """Draw :func:`step_breakdown` as a PNG at ``path``: one panel per rank, its step
    time over the run stacked as waiting for data, compute, communication and waiting
    for the other ranks. Steps far above the usual (an epoch's evaluation) run off the
    top. Needs matplotlib; returns False (and draws nothing) without step records."""
    steps = step_breakdown()
    if not steps or not any(steps.values()):
        return False
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(steps), 1, figsize=(10, 1.6 + 1.6 * len(steps)),
                             sharex=True, squeeze=False)
    labels = ("data", "compute", "communication", "waiting for other ranks")
    colors = ("tab:orange", "tab:blue", "tab:green", "tab:gray")
    totals = sorted(1e3 * row[2] for rows in steps.values() for row in rows)
    top = min(totals[-1], 3 * totals[int(0.9 * (len(totals) - 1))]) * 1.05
    for ax, (rank, rows) in zip(axes[:, 0], steps.items()):
        starts = [row[1] - row[2] for row in rows]      # each step from its start
        parts = [[1e3 * row[3 + i] for row in rows] for i in range(4)]
        ax.stackplot(starts, *parts, labels=labels, colors=colors, alpha=0.85,
                     step="post")
        ax.set(ylabel="ms per step", title=f"rank {rank}", ylim=(0, top))
        ax.grid(alpha=0.3)
    axes[0, 0].legend(loc="upper right", fontsize="small", ncol=4)
    axes[-1, 0].set_xlabel("seconds since the first step")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
    return True


def steps_plot_path(plot: str) -> str:
    """Where an example puts its step-time plot: beside ``plot`` (its training curves),
    ``runs/mnist.png`` -> ``runs/mnist-steps.png``."""
    root, ext = os.path.splitext(plot)
    return f"{root}-steps{ext or '.png'}"
