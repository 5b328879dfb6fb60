"""The channel between the launchers of one job: every node's launcher keeps one TCP
connection to node 0's launcher (the master) and exchanges JSON messages, one per line.

Both sides send at least every HEARTBEAT seconds (statuses, ticks); a side that hears
nothing for SILENCE seconds treats the other as gone (a machine that loses power or its
network closes no connection). Sending never blocks the caller: messages go out through
a writer thread, and a side whose message has not left after SILENCE seconds (the peer
stopped reading, so TCP stopped taking data) treats the other as gone too. Both are
launcher options (--heartbeat, --silence-limit).

node -> master: hello {node, host, nproc}, status {states, service_failure,
services_ended}, stacks {found}, stopped
master -> node: start {spec}, hint {low}, verdicts {verdicts}, stacks {ranks},
end {status, report, again}, tick
"""
from __future__ import annotations

import json
import queue
import socket
import threading
import time

HEARTBEAT = 0.5        # default of --heartbeat
SILENCE = 8.0          # default of --silence-limit


class Link:
    """One connection; received messages queue up in ``inbox`` (None marks the end)."""

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self.inbox: queue.Queue = queue.Queue()
        self._outbox: queue.Queue = queue.Queue()
        self._sending_since: float | None = None
        self.closed = False
        self.last_heard = time.monotonic()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._write, daemon=True).start()

    def _read(self):
        try:
            with self._sock.makefile("rb") as stream:
                for line in stream:
                    self.last_heard = time.monotonic()
                    self.inbox.put(json.loads(line))
        except (OSError, ValueError):
            pass
        self.closed = True
        self.inbox.put(None)

    def _write(self):
        while True:
            data = self._outbox.get()
            if data is None:
                return
            self._sending_since = time.monotonic()
            try:
                self._sock.sendall(data)
            except OSError:
                self.closed = True
                return
            finally:
                self._sending_since = None
                self._outbox.task_done()

    def send(self, message: dict) -> bool:
        """Queue ``message``; never blocks. False when the link is closed."""
        if self.closed:
            return False
        self._outbox.put((json.dumps(message) + "\n").encode())
        return True

    def stuck_for(self) -> float:
        """Seconds the message being sent has waited for the peer to take it."""
        since = self._sending_since
        return 0.0 if since is None else time.monotonic() - since

    def gone(self, silence: float) -> bool:
        """Nothing heard for ``silence`` seconds, or a message not taken for as long."""
        return self.silent_for() > silence or self.stuck_for() > silence

    def receive(self, timeout: float | None = None) -> dict | None:
        """The next message; None when the link closed; raises queue.Empty on timeout."""
        return self.inbox.get(timeout=timeout)

    def close(self, flush: float = 1.0):
        """Close, after giving queued messages ``flush`` seconds to leave."""
        limit = time.monotonic() + flush
        while self._outbox.unfinished_tasks and not self.closed \
                and time.monotonic() < limit:
            time.sleep(0.01)
        self.closed = True
        self._outbox.put(None)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


    def silent_for(self) -> float:
        """Seconds since the last message: a machine that vanished closes nothing."""
        return time.monotonic() - self.last_heard


class JoinError(RuntimeError):
    """A node did not join the job in time."""


def accept_nodes(port: int, nnodes: int, timeout: float, say) -> dict[int, tuple[Link, dict]]:
    """Node 0: wait for the launchers of nodes 1..nnodes-1 to connect and say hello."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        server.bind(("", port))
    except OSError as err:
        raise JoinError(f"cannot listen on port {port} for the other nodes' launchers: "
                        f"{err}; choose another --master-port") from err
    server.listen(nnodes)
    server.settimeout(0.2)
    deadline = time.monotonic() + timeout
    joined: dict[int, tuple[Link, dict]] = {}
    pending: list[Link] = []
    try:
        while len(joined) < nnodes - 1:
            if time.monotonic() > deadline:
                missing = sorted(set(range(1, nnodes)) - set(joined))
                for link, _ in joined.values():
                    link.close()
                raise JoinError(
                    f"node rank{'s' if len(missing) > 1 else ''} "
                    f"{', '.join(map(str, missing))} never joined within --join-timeout "
                    f"{timeout:g} s (start the same command with --node-rank "
                    f"{missing[0]} on that machine, and check that it reaches this one at "
                    f"the --master-addr and --master-port {port})")
            try:
                sock, _ = server.accept()
                pending.append(Link(sock))
            except TimeoutError:
                pass
            for link in list(pending):
                try:
                    hello = link.inbox.get_nowait()
                except queue.Empty:
                    continue
                pending.remove(link)
                if not hello or hello.get("type") != "hello":
                    link.close()
                    continue
                node = hello["node"]
                if node in joined or not 0 < node < nnodes:
                    link.send({"type": "end", "status": 2, "again": False,
                               "report": f"node rank {node} is taken or out of range "
                                         f"[1, {nnodes}); give each machine its own "
                                         "--node-rank"})
                    link.close()
                    continue
                joined[node] = (link, hello)
                say(f"node {node} ({hello['host']}) joined "
                    f"({len(joined) + 1} of {nnodes} nodes)")
    finally:
        server.close()
    return joined


def connect_to_master(addr: str, port: int, hello: dict, timeout: float) -> Link:
    """Nodes 1..M-1: connect to node 0's launcher, retrying until ``timeout``."""
    deadline = time.monotonic() + timeout
    last_error = None
    while time.monotonic() < deadline:
        try:
            sock = socket.create_connection((addr, port), timeout=5)
            sock.settimeout(None)
            link = Link(sock)
            link.send(hello)
            return link
        except OSError as err:
            last_error = err
            time.sleep(0.5)
    raise JoinError(f"cannot reach the master launcher at {addr}:{port} within "
                    f"--join-timeout {timeout:g} s ({last_error}); start node 0 with the "
                    "same --master-addr/--master-port, and check the address is reachable "
                    "from this machine")
