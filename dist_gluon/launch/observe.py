"""The launcher's side of observability: the directory its workers' reporter writes to
(dist_gluon/timeline.py), the per-rank report at the end of the job and every
``--report-every`` seconds (report.py), live progress on a terminal, and the job's
timeline (``--timeline FILE``): every rank's trace events and the launcher's own
messages (formation, restarts, failures, stalls) merged into one Chrome trace JSON.

Every process of a host reads the same CLOCK_MONOTONIC, so the workers' and the
launcher's events share one time axis without any offset. The other nodes' launchers
send their ranks' step records to node 0 with their status reports; node 0 places them
on its clock by their arrival, and reports every rank. The timeline holds node 0's
ranks (the others' trace events stay on their hosts).
"""
from __future__ import annotations

import collections
import glob
import json
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


class Observation:
    """Node 0's observation of one job: created before the first round, finished
    after the last. ``out`` is the launcher's output (its ``say``); this object is
    one too, and records what it says as instant events of the timeline."""

    def __init__(self, timeline_file: str | None, mode: str, every: float | None, out,
                 forwarding: bool = False):
        self.timeline_file, self.mode, self.every, self.out = timeline_file, mode, every, out
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
        records = rounds[latest]
        hosts = {rank: self._hosts.get(f"rank{rank}.r{latest}", self.host)
                 for rank in records}
        return _report.build(records, hosts, dict(self._cores))

    # ------------------------------------------------------------------ other nodes
    def outgoing(self) -> dict | None:
        """Another node: its ranks' step records since the last call, with this
        host's monotonic clock now (node 0 places them on its own clock by the time
        they arrive); None when there are none."""
        new = {}
        for path in glob.glob(os.path.join(self.directory, "rank*.steps")):
            rows, self._offsets[path] = timeline.read_steps(path, self._offsets.get(path, 0))
            if rows:
                new[os.path.basename(path)[:-len(".steps")]] = rows
        if not new:
            return None
        return {"clock": time.monotonic(), "host": self.host,
                "cores": os.cpu_count() or 1, "records": new}

    def incoming(self, steps: dict, received: float) -> None:
        """Node 0: another node's ``outgoing()``, arrived at ``received`` (this
        launcher's monotonic clock). Its times move by the difference of the two
        clocks, so the one-way latency of the link is the error."""
        shift = received - steps["clock"]
        with self._lock:
            self._cores[steps["host"]] = steps["cores"]
            for key, rows in steps["records"].items():
                self._hosts[key] = steps["host"]
                self._records.setdefault(f"remote/{key}.steps",
                                         collections.deque(maxlen=KEEP)).extend(
                    (row[0], *(t + shift for t in row[1:6]), *row[6:]) for row in rows)

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
        ranks = set()
        for path in sorted(glob.glob(os.path.join(self.directory, "rank*.trace"))):
            match = _FILE.search(path)
            ranks.add(int(match[1]))
            with open(path) as f:
                for line in f:
                    line = line.strip()
                    if line:
                        try:
                            events.append(json.loads(line))
                        except ValueError:
                            pass        # a line cut short by a killed worker
        for rank in sorted(ranks):
            events.append({"name": "process_name", "ph": "M", "pid": rank,
                           "args": {"name": f"rank {rank} ({self.host})"}})
            events.append({"name": "process_sort_index", "ph": "M", "pid": rank,
                           "args": {"sort_index": rank}})
            for tid, name in enumerate(("python", "engine: compute",
                                        "engine: collectives")):
                events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                               "args": {"name": name}})
        for when, text in self._said:
            events.append({"name": text.splitlines()[0][:120], "cat": "launcher",
                           "ph": "i", "s": "g", "pid": -1, "tid": 0,
                           "ts": round(when * 1e6, 1), "args": {"message": text}})
        with open(self.timeline_file, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms",
                       "otherData": {"producer": "dist_gluon.launch --timeline"}}, f)
        self.out.say(f"timeline of {len(ranks)} ranks written to {self.timeline_file} "
                     "(open it in https://ui.perfetto.dev or chrome://tracing)")


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
