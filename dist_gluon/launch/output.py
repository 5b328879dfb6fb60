"""The launcher's output: every line its workers and it print goes to its own stdout or
stderr without ever blocking the launcher.

A launcher whose output nobody reads (a full pipe, a stopped terminal, a log collector
that hangs) must go on supervising: a blocked write would stop it relaying its workers'
output (so they block on their next print) and, on a node of a multi-node job, stop its
heartbeats (so node 0 ends a healthy job). So lines are queued, and one writer thread per
stream writes them with ``os.write``; while a stream is blocked the queue grows up to
``LIMIT_BYTES``, then further lines are dropped and counted, and a notice says how many
once the stream moves again. At exit :func:`drain` waits for the queues to empty, up to
a deadline.
"""
from __future__ import annotations

import collections
import os
import sys
import threading
import time

# Output held while a stream is blocked, per stream, before lines are dropped.
LIMIT_BYTES = 64 << 20


class _Stream:
    def __init__(self, fd: int, name: str):
        self.fd, self.name = fd, name
        self.queue: collections.deque[bytes] = collections.deque()
        self.queued = 0
        self.dropped = 0
        self.lock = threading.Condition()
        self.busy = False
        threading.Thread(target=self._write_loop, daemon=True,
                         name=f"dist_gluon.launch {name}").start()

    def put(self, data: bytes) -> None:
        with self.lock:
            if self.queued + len(data) > LIMIT_BYTES:
                self.dropped += 1
                return
            self.queue.append(data)
            self.queued += len(data)
            self.lock.notify()

    def _write_loop(self) -> None:
        while True:
            with self.lock:
                while not self.queue:
                    self.busy = False
                    self.lock.notify_all()
                    self.lock.wait()
                self.busy = True
                data = self.queue.popleft()
                self.queued -= len(data)
                dropped, self.dropped = self.dropped, 0
            if dropped:
                data = (f"dist_gluon.launch: {dropped} line(s) of output were dropped while "
                        f"{self.name} was blocked (nobody read it)\n").encode() + data
            try:
                while data:
                    data = data[os.write(self.fd, data):]
            except OSError:
                pass            # a closed stream: the lines have nowhere to go

    def drain(self, deadline: float) -> bool:
        with self.lock:
            while self.queue or self.busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.lock.wait(left)
            return True


_streams: dict[bool, _Stream] = {}
_streams_lock = threading.Lock()


def _stream(to_stderr: bool) -> _Stream:
    stream = _streams.get(to_stderr)
    if stream is None:
        with _streams_lock:
            stream = _streams.get(to_stderr)
            if stream is None:
                for f in (sys.stdout, sys.stderr):
                    try:
                        f.flush()       # what Python buffered before goes first
                    except (OSError, ValueError):
                        pass
                stream = _streams[to_stderr] = _Stream(
                    2 if to_stderr else 1, "stderr" if to_stderr else "stdout")
    return stream


def emit(text: str, to_stderr: bool = True) -> None:
    """Queue ``text`` (whole lines) for the launcher's stderr or stdout; never blocks."""
    _stream(to_stderr).put(text.encode("utf-8", "replace"))


def drain(timeout: float = 10.0) -> bool:
    """Wait up to ``timeout`` seconds for every queued line to be written; False if a
    stream is still blocked (the caller should then exit without flushing)."""
    deadline = time.monotonic() + timeout
    return all(s.drain(deadline) for s in list(_streams.values()))
