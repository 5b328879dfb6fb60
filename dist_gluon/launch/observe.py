"""The launcher's side of observability: the directory its workers' reporter writes to
(dist_gluon/timeline.py), the per-rank report at the end of the job and every
``--report-every`` seconds (report.py), live progress on a terminal, and the job's
timeline (``--timeline FILE``): every rank's trace events and every node's launcher's
messages (formation, restarts, failures, stalls) merged into one Chrome trace JSON.

Every process of a host reads the same CLOCK_MONOTONIC, so the workers' and the
launcher's events share one time axis without any offset. The other nodes' launchers
send their ranks' step records and trace events, and what they said, to node 0 with
their status reports (as they come, so a node lost mid-job keeps what it sent); node 0
places them on its
own clock with an offset estimated per node from the status reports and node 0's ticks
(:class:`_Clock`), reports every rank and writes every rank into the one timeline, the
offsets and their error bounds in its metadata.
"""
from __future__ import annotations

import collections
import glob
import json
import math
import os
import re
import shutil
import socket
import sys
import tempfile
import threading
import time

from .. import timeline
from . import output
from . import report as _report

PROGRESS_EVERY = 5.0    # seconds between progress lines on a terminal
# step records kept per rank and round: the report covers the latest this many steps
# (a long job's whole history would grow the launcher by 100 bytes a step and rank)
KEEP = 20000
_FILE = re.compile(r"rank(\d+)\.r(\d+)\.(steps|trace)$")
# bytes of trace events one status report carries at most (the channel takes lines of
# up to 64 MiB); the rest follows with the next reports
TRACE_PER_STATUS = 4 << 20


class _Clock:
    """Another launcher's CLOCK_MONOTONIC against node 0's, as NTP bounds an offset by
    round trips, here from one-way trips both ways (no message is added):

    - a status report carries the node's clock when it left, node 0 notes its own
      when it arrived: node 0's clock minus the node's (the offset) is at most
      arrival - departure (the trip took some time);
    - a tick of node 0 carries node 0's clock when it left, the node notes its own
      when it arrived and sends the largest departure - arrival back: the offset is at
      least that.

    The offset is the middle of the tightest bounds seen, its error at most half their
    distance (the fastest trip each way, plus how late either side noticed the
    message). Two clocks that drift apart (a few parts per million under NTP) end
    with bounds that cross: then only the latest pair counts.
    """

    def __init__(self, host: str):
        self.host = host
        self.high = math.inf        # offset <= high: from the status reports
        self.low = -math.inf        # offset >= low: from node 0's ticks
        self.reports = 0
        self.ranks: set[int] = set()

    def note(self, high: float, low: float | None) -> None:
        self.reports += 1
        self.high = min(self.high, high)
        if low is not None and math.isfinite(low):
            self.low = max(self.low, low)
        if self.low > self.high:        # drift: start again from the latest pair
            self.high = high
            self.low = low if low is not None and low <= high else -math.inf

    @property
    def offset(self) -> float:
        """Seconds to add to the node's times to place them on node 0's clock (before
        the first tick came back, the fastest status's arrival: late by its trip)."""
        if not math.isfinite(self.low):
            return self.high
        return (self.low + self.high) / 2

    @property
    def error(self) -> float | None:
        """The most the offset can be wrong by, in seconds (None: not bounded yet)."""
        return (self.high - self.low) / 2 if math.isfinite(self.low) else None

    def to_json(self) -> dict:
        return {"host": self.host, "ranks": sorted(self.ranks), "offset_s": self.offset,
                "error_bound_s": self.error, "status_reports": self.reports}


class Observation:
    """Node 0's observation of one job: created before the first round, finished
    after the last. ``out`` is the launcher's output (its ``say``); this object is
    one too, and records what it says as instant events of the timeline."""

    def __init__(self, timeline_file: str | None, mode: str, every: float | None, out,
                 forwarding: bool = False, asynchronous: bool = False):
        self.timeline_file, self.mode, self.every, self.out = timeline_file, mode, every, out
        # dist_async: the ranks do not wait for each other (report.breakdown)
        self.asynchronous = asynchronous
        # another node's launcher: its ranks' records go to node 0 (outgoing), which
        # reports and draws the job
        self.forwarding = forwarding
        self.directory = tempfile.mkdtemp(prefix="dg-observe-")
        self.host = socket.gethostname()
        self._said: list[tuple[float, str]] = [(time.monotonic(), "job started")]
        self._stop = threading.Event()
        self._offsets: dict[str, int] = {}
        self._records: dict[str, collections.deque] = {}
        self._hosts: dict[str, str] = {}        # record key -> host, for other nodes'
        self._cores: dict[str, int] = {self.host: os.cpu_count() or 1}
        # node 0: another launcher (by its "source") -> its clock and its directory here
        self._clocks: dict[str, _Clock] = {}
        self._remote: dict[str, str] = {}
        self._remote_said: dict[str, list] = {}     # source -> [when, text], its clock
        # another node: the launcher's own name, and the lower bound of node 0's clock
        # minus this one, from node 0's ticks (_Clock)
        self.source = f"{self.host}/{os.getpid()}"
        self._low = -math.inf
        self._unsent = 0        # self._said[self._unsent:] has not gone to node 0 yet
        self._lock = threading.Lock()
        self._thread = None
        if not forwarding and (every or sys.stderr.isatty()):
            self._thread = threading.Thread(target=self._periodic, daemon=True,
                                            name="dist_gluon.launch report")
            self._thread.start()

    def environ(self) -> dict[str, str]:
        """What the workers need to report: the directory and the level."""
        return {timeline.ENV_DIR: self.directory,
                timeline.ENV_LEVEL: "timeline" if self.timeline_file else "steps"}

    def say(self, text: str) -> None:
        with self._lock:
            self._said.append((time.monotonic(), text))
        self.out.say(text)

    # ------------------------------------------------------------------ records
    def _read(self) -> dict[int, dict[int, list[tuple]]]:
        """Every step record so far: restart -> rank -> records (read incrementally)."""
        with self._lock:
            for path in glob.glob(os.path.join(self.directory, "rank*.steps")):
                rows, self._offsets[path] = timeline.read_steps(
                    path, self._offsets.get(path, 0))
                self._records.setdefault(path, collections.deque(maxlen=KEEP)).extend(rows)
            rounds: dict[int, dict[int, list[tuple]]] = {}
            for path, rows in self._records.items():
                match = _FILE.search(path)
                if match and rows:
                    rounds.setdefault(int(match[2]), {})[int(match[1])] = list(rows)
            return rounds

    def report(self) -> _report.Report | None:
        """The report of the latest round that made steps (None before any)."""
        rounds = self._read()
        if not rounds:
            return None
        latest = max(rounds)
        records, kept_from, steps = across_rounds(rounds)
        hosts = {rank: self._hosts.get(f"rank{rank}.r{kept_from.get(rank, latest)}",
                                       self.host) for rank in records}
        report = _report.build(records, hosts, dict(self._cores), self.asynchronous)
        for row in report.ranks:
            row.steps = steps.get(row.rank, row.steps)
        return report

    # ------------------------------------------------------------------ other nodes
    def outgoing(self) -> dict | None:
        """Another node: its ranks' step records and trace events, and what its launcher
        said, since the last call, with this host's monotonic clock now and the bound
        from node 0's ticks (:class:`_Clock`); None when there are none."""
        new, trace, room = {}, {}, TRACE_PER_STATUS
        for path in glob.glob(os.path.join(self.directory, "rank*.steps")):
            rows, self._offsets[path] = timeline.read_steps(path, self._offsets.get(path, 0))
            if rows:
                new[os.path.basename(path)[:-len(".steps")]] = rows
        for path in sorted(glob.glob(os.path.join(self.directory, "rank*.trace"))):
            if room <= 0:
                break
            start = self._offsets.get(path, 0)
            lines, self._offsets[path] = timeline.read_lines(path, start, room)
            room -= self._offsets[path] - start
            if lines:
                trace[os.path.basename(path)[:-len(".trace")]] = lines
        with self._lock:
            said, self._unsent = self._said[self._unsent:], len(self._said)
        if not new and not trace and not said:
            return None
        steps = {"clock": time.monotonic(), "host": self.host, "source": self.source,
                 "cores": os.cpu_count() or 1, "records": new}
        if trace:
            steps["trace"] = trace
        if said:
            steps["said"] = [list(item) for item in said]
        if math.isfinite(self._low):
            steps["low"] = self._low
        return steps

    def tick(self, clock: float | None, received: float) -> None:
        """Another node: node 0's tick that left at ``clock`` (node 0's monotonic
        clock) arrived at ``received`` (this launcher's)."""
        if clock is not None:
            self._low = max(self._low, clock - received)

    def incoming(self, steps: dict, received: float) -> None:
        """Node 0: another node's ``outgoing()``, arrived at ``received`` (this
        launcher's monotonic clock). Its times move by the offset of the two clocks
        as estimated so far (:class:`_Clock`); its trace events are kept as they came
        and placed when the timeline is written, with the final estimate, as is what
        its launcher said."""
        if self.forwarding:     # a node that took over as the job's host
            return
        source = steps.get("source", steps["host"])
        with self._lock:
            clock = self._clocks.get(source)
            if clock is None:
                clock = self._clocks[source] = _Clock(steps["host"])
                self._remote[source] = os.path.join(self.directory, "remote",
                                                    str(len(self._remote)))
                os.makedirs(self._remote[source], exist_ok=True)
            clock.note(received - steps["clock"], steps.get("low"))
            self._remote_said.setdefault(source, []).extend(steps.get("said", ()))
            shift = clock.offset
            self._cores[steps["host"]] = steps["cores"]
            for key, rows in steps["records"].items():
                self._hosts[key] = steps["host"]
                placed = [(row[0], *(t + shift for t in row[1:6]), *row[6:]) for row in rows]
                self._records.setdefault(f"remote/{key}.steps",
                                         collections.deque(maxlen=KEEP)).extend(placed)
                # on disk too, for timeline.step_breakdown() in node 0's ranks
                with open(os.path.join(self._remote[source], key + ".steps"), "ab") as f:
                    f.write(b"".join(timeline.STEP.pack(*row) for row in placed))
            for key, lines in steps.get("trace", {}).items():
                match = _FILE.search(key + ".trace")
                if match:
                    clock.ranks.add(int(match[1]))
                    with open(os.path.join(self._remote[source], key + ".trace"), "a") as f:
                        f.write("\n".join(lines) + "\n")

    def _print(self, title: str) -> None:
        report = self.report()
        if report is None:
            return
        if self.mode == "json":
            output.emit(json.dumps({"dist_gluon_report": title, **report.to_json()}) + "\n",
                        to_stderr=False)
        else:
            self.out.say(_report.table(report, title))

    # ------------------------------------------------------------------ periodic
    def _periodic(self) -> None:
        next_report = time.monotonic() + (self.every or 0)
        tty = sys.stderr.isatty()
        while not self._stop.wait(min(self.every or PROGRESS_EVERY, PROGRESS_EVERY)):
            now = time.monotonic()
            if self.every and now >= next_report and self.mode != "off":
                next_report = now + self.every
                self._print("report so far")
            elif tty:
                self._progress()

    def _progress(self) -> None:
        """One line: rank 0's steps, steps/s and samples/s over the last interval, and
        the time left when the script said how many steps it makes."""
        rounds = self._read()
        if not rounds:
            return
        records = rounds[max(rounds)]
        mine = records.get(0) or next(iter(records.values()))
        if len(mine) < 2:
            return
        recent = [r for r in mine if r[3] >= mine[-1][3] - PROGRESS_EVERY] or mine[-2:]
        if len(recent) < 2:
            recent = mine[-2:]
        seconds = recent[-1][3] - recent[0][3]
        rate = (len(recent) - 1) / seconds if seconds > 0 else 0.0
        samples = sum(r[-1][8] for r in records.values() if r) * rate
        line = f"progress: step {mine[-1][0]}"
        total = timeline.expected_steps(self.directory)
        if total:
            line += f" of {total}"
        line += f", {rate:.2f} steps/s, {samples:.0f} samples/s"
        if total and rate > 0 and total > mine[-1][0]:
            line += f", {_duration((total - mine[-1][0]) / rate)} left"
        self.out.say(line)

    # ------------------------------------------------------------------ the end
    def finish(self) -> None:
        """The job ended: print the report, write the timeline, remove the records."""
        self._stop.set()
        try:
            if self.forwarding:
                return
            if self.mode != "off":
                self._print("report")
            if self.timeline_file:
                try:
                    self._write_timeline()
                except OSError as err:
                    self.out.say(f"cannot write the timeline to {self.timeline_file}: {err}")
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)

    def _write_timeline(self) -> None:
        events = [{"name": "process_name", "ph": "M", "pid": -1,
                   "args": {"name": f"launcher ({self.host})"}},
                  {"name": "process_sort_index", "ph": "M", "pid": -1,
                   "args": {"sort_index": -1}}]
        hosts: dict[int, str] = {}
        places = [(self.directory, self.host, 0.0)] + [
            (self._remote[source], clock.host, clock.offset)
            for source, clock in self._clocks.items()]
        for directory, host, offset in places:
            shift = round(offset * 1e6, 1)
            for path in sorted(glob.glob(os.path.join(directory, "rank*.trace"))):
                hosts[int(_FILE.search(path)[1])] = host
                with open(path) as f:
                    for line in f:
                        try:
                            event = json.loads(line)
                        except ValueError:
                            continue    # a line cut short by a killed worker
                        if shift and "ts" in event:
                            event["ts"] = round(event["ts"] + shift, 1)
                        events.append(event)
        ranks = set(hosts)
        for rank in sorted(ranks):
            events.append({"name": "process_name", "ph": "M", "pid": rank,
                           "args": {"name": f"rank {rank} ({hosts[rank]})"}})
            events.append({"name": "process_sort_index", "ph": "M", "pid": rank,
                           "args": {"sort_index": rank}})
            for tid, name in enumerate(("python", "engine: compute",
                                        "engine: collectives")):
                events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                               "args": {"name": name}})
        events += _said_events(self._said, -1, 0.0, "g")
        # each other node's launcher on a track of its own (pids -2, -3, ...), its
        # messages placed with its clock's offset
        for index, (source, clock) in enumerate(self._clocks.items()):
            pid = -2 - index
            events.append({"name": "process_name", "ph": "M", "pid": pid,
                           "args": {"name": f"launcher ({clock.host})"}})
            events.append({"name": "process_sort_index", "ph": "M", "pid": pid,
                           "args": {"sort_index": -1}})
            events += _said_events(self._remote_said.get(source, ()), pid, clock.offset,
                                   "p")
        with open(self.timeline_file, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms",
                       "otherData": {"producer": "dist_gluon.launch --timeline",
                                     "clock": f"CLOCK_MONOTONIC of {self.host} (node 0)",
                                     # other nodes' offsets and how far off they can be
                                     "clocks": [c.to_json() for c in self._clocks.values()]}},
                      f)
        self.out.say(f"timeline of {len(ranks)} ranks written to {self.timeline_file} "
                     "(open it in https://ui.perfetto.dev or chrome://tracing)")


def across_rounds(rounds: dict[int, dict[int, list[tuple]]]
                  ) -> tuple[dict[int, list[tuple]], dict[int, int], dict[int, int]]:
    """The latest round's step records for the report, every rank of it included,
    from ``rounds`` (round -> rank -> records): (rank -> records, rank -> the round
    whose file a kept rank writes, rank -> its steps over every round).

    A worker kept through an in-memory re-formation keeps writing the file of the round
    it started in, its step numbers going on; its records made after the latest round
    began are its part of that round, numbered as the round's new ranks number theirs
    (the report lines ranks up by step number). Steps are summed over the rounds: a
    rank's new process adds to what its predecessor made; a kept one counts its own."""
    latest = max(rounds)
    records = dict(rounds[latest])
    # the round's first step, less half a step: a kept rank's first step of the round
    # ends with the new ranks' (their sums end together), a little before or after
    begun = min((rows[0][3] - (rows[1][3] - rows[0][3]) / 2 if len(rows) > 1 else rows[0][3]
                 for rows in records.values() if rows), default=math.inf)
    first = min((rows[0][0] for rows in records.values() if rows), default=1)
    made = {rank: rows[-1][0] - rows[0][0] + 1 for rank, rows in records.items() if rows}
    kept_from: dict[int, int] = {}
    for number in sorted(rounds, reverse=True):
        if number == latest:
            continue
        for rank, rows in rounds[number].items():
            if not rows:
                continue
            if rank not in records and rows[-1][3] > begun:
                since = [row for row in rows if row[3] > begun]
                shift = since[0][0] - first
                records[rank] = [(row[0] - shift, *row[1:]) for row in since]
                kept_from[rank] = number
                made[rank] = rows[-1][0]
            elif rank not in kept_from:
                made[rank] = made.get(rank, 0) + rows[-1][0] - rows[0][0] + 1
    return records, kept_from, made


def _said_events(said, pid: int, offset: float, scope: str) -> list[dict]:
    """A launcher's messages as instant events on track ``pid``: node 0's span the
    whole trace (scope "g"), another node's mark its own track ("p")."""
    return [{"name": text.splitlines()[0][:120], "cat": "launcher", "ph": "i", "s": scope,
             "pid": pid, "tid": 0, "ts": round((when + offset) * 1e6, 1),
             "args": {"message": text}} for when, text in said]


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
