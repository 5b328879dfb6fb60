"""The channel between the launchers of one job: every node's launcher keeps one TCP
connection to node 0's launcher (the master) and exchanges JSON messages, one per line.

Both sides send at least every HEARTBEAT seconds (statuses, ticks); a side that hears
nothing for SILENCE seconds treats the other as gone (a machine that loses power or its
network closes no connection). Sending never blocks the caller: messages go out through
a writer thread, and a side whose message has not left after SILENCE seconds (the peer
stopped reading, so TCP stopped taking data) treats the other as gone too. Both are
launcher options (--heartbeat, --silence-limit).

Only the job's own launchers get in. Every job has a secret (secret.py). Node 0 sends
each new connection a random challenge (one plain JSON line); from then on every line
in either direction is ``<hmac> <json>``, where the HMAC-SHA256 made with the secret
covers the direction, the challenge, the connecting side's nonce (sent in its hello,
then covered by every later message) and the message's sequence number in its
direction. So a message made without the secret, altered, taken from another
connection, replayed or reordered does not authenticate, as horovodrun's services
sign theirs with their secret key and a nonce. Node 0 drops such a connection, or one
that sends a line longer than HELLO_LIMIT before its hello authenticated (LINE_LIMIT
after), or no hello within HANDSHAKE_TIMEOUT, logs it with the peer's address and goes
on waiting for the job's own launchers; once every node has joined it listens no more
(an elastic job's node 0 keeps listening for nodes that join later: ``Listener``).

A burst of launchers (``srun`` starts hundreds at once) gets in whole: node 0 serves at
most HALF_OPEN_LIMIT connections that have not said hello yet (strangers cannot make it
hold more), and the others wait in the kernel's queue of the listening socket, sized
for the job's nodes, until a hello frees a place. A join is complete when the host
sends its :class:`~dist_gluon.launch.protocol.Welcome`; a launcher whose join fails
before that for a reason that can pass (node 0 not listening yet, too busy to answer
within HANDSHAKE_TIMEOUT, the connection dropped) tries again after a jittered,
growing wait (:class:`Backoff`) until --join-timeout.

The messages themselves, and the spec of a round, are protocol.py's dataclasses; a hello
carries the connecting side's nonce besides what protocol.Hello says.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import queue
import random
import secrets
import socket
import threading
import time

from .protocol import End, Message, Tick, Welcome
from .secret import ENV as SECRET_ENV
from .secret import FILE_FLAG as SECRET_FILE_FLAG

HEARTBEAT = 0.5        # default of --heartbeat
SILENCE = 8.0          # default of --silence-limit
STATUS_EVERY = 0.1     # seconds between a node's status reports
HELLO_LIMIT = 64 << 10          # bytes of a line before the peer has authenticated
LINE_LIMIT = 64 << 20           # after: a stacks report of many ranks can be long
HANDSHAKE_TIMEOUT = 10.0        # seconds to send the challenge or the hello
# connections served at once that have not said hello yet; more wait in the kernel's
# queue (LaunchConfig.half_open_limit, from DG_HALF_OPEN_LIMIT)
HALF_OPEN_LIMIT = 32
_DIFFERENT_SECRET = (
    f"a launcher given a different {SECRET_ENV} or {SECRET_FILE_FLAG} than node 0's "
    "(give every node the same one), or not one of this job's launchers at all")


class Refused(Exception):
    """A line that does not authenticate; the connection is dropped."""


class _Seal:
    """The HMACs of one connection, as seen from one side (``outgoing`` is "m" on the
    master's side, "n" on a node's)."""

    def __init__(self, secret: str, challenge: str, outgoing: str):
        self._key = secret.encode()
        self.challenge = challenge
        self.nonce = ""         # the connecting side's, from its hello on
        self._out, self._in = outgoing, "n" if outgoing == "m" else "m"
        self.sent = self.received = 0

    def _mac(self, direction: str, number: int, body: bytes) -> bytes:
        head = f"dist_gluon {direction} {self.challenge} {self.nonce} {number}\n".encode()
        return hmac.new(self._key, head + body, hashlib.sha256).hexdigest().encode()

    def seal(self, message: dict | bytes) -> bytes:
        """The line that carries ``message`` (or its JSON text) as the next one."""
        body = message if isinstance(message, bytes) else json.dumps(message).encode()
        line = self._mac(self._out, self.sent, body) + b" " + body + b"\n"
        self.sent += 1
        return line

    def seal_hello(self, hello: dict) -> bytes:
        """The connecting side's first message; its nonce covers every later one."""
        line = self.seal(hello)
        self.nonce = hello["nonce"]
        return line

    def open(self, line: bytes) -> dict:
        """The message in ``line``; raises Refused unless it is the next one the other
        side signed on this connection."""
        mac, _, body = line.rstrip(b"\n").partition(b" ")
        signed = len(mac) == 64 and body.startswith(b"{")
        if not (signed and hmac.compare_digest(mac, self._mac(self._in, self.received,
                                                               body))):
            if self.received:
                raise Refused(f"its message {self.received} does not authenticate "
                              "(altered, replayed or forged)")
            raise Refused(_unsigned_hello(body if signed else line, signed))
        message = json.loads(body)
        if self.received == 0 and self._in == "n":
            if message.get("type") != "hello" or not isinstance(message.get("nonce"), str):
                raise Refused("its first message is not a hello")
            self.nonce = message["nonce"]
        self.received += 1
        return message


def _unsigned_hello(text: bytes, signed: bool) -> str:
    """What to say of a first message that does not authenticate."""
    try:
        claim = json.loads(text)
        node = claim["node"] if claim.get("type") == "hello" else None
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
        node = None
    if not isinstance(node, int):
        return ("its first message does not authenticate with this job's secret" if signed
                else "it sent something that is not a signed dist_gluon message")
    if not signed:
        return f"it says it is node {node}'s launcher but its hello is not signed at all"
    return (f"it says it is node {node}'s launcher but its hello does not authenticate "
            f"with this job's secret: {_DIFFERENT_SECRET}, or a replayed or forged hello")


class Link:
    """One authenticated connection; received messages queue up in ``inbox`` (None marks
    the end). ``refusal`` says why the connection was dropped, if it was; ``say``, when
    given, is told so with the peer's address at once."""

    def __init__(self, sock: socket.socket, seal: _Seal, peer: str, say=None):
        self._sock, self._seal, self.peer, self._say = sock, seal, peer, say
        self.inbox: queue.Queue = queue.Queue()
        self._outbox: queue.Queue = queue.Queue()
        self._sending_since: float | None = None
        self.closed = False
        self.refusal: str | None = None
        self.last_heard = time.monotonic()
        self.opened_at = time.monotonic()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._write, daemon=True).start()

    def _read(self):
        try:
            with self._sock.makefile("rb") as stream:
                while True:
                    limit = LINE_LIMIT if self._seal.received else HELLO_LIMIT
                    line = stream.readline(limit + 1)
                    if len(line) > limit:
                        raise Refused(f"it sent a line longer than {limit} bytes")
                    if not line.endswith(b"\n"):
                        break
                    try:
                        message = self._seal.open(line)
                    except Refused:
                        self._refused_by_master(line)
                        raise
                    self.last_heard = time.monotonic()
                    self.inbox.put(message)
        except Refused as err:
            self.refusal = str(err)
            self._tell_refused()
        except (OSError, ValueError):
            pass
        self.closed = True
        if self.refusal is not None:
            self._drop()
        self.inbox.put(None)

    def _refused_by_master(self, line: bytes) -> None:
        """A node whose hello node 0 could not authenticate hears so in plain text."""
        if self._seal._in != "m" or self._seal.received:
            return
        try:
            notice = json.loads(line)
        except (ValueError, RecursionError):
            return
        if isinstance(notice, dict) and notice.get("refused") == "hello":
            raise Refused(f"node 0's launcher at {self.peer} refused this launcher: its "
                          f"hello does not authenticate with node 0's job secret; give "
                          f"every node the same {SECRET_ENV} or {SECRET_FILE_FLAG}")

    def _tell_refused(self) -> None:
        joining = self._seal._in == "n" and self._seal.received == 0
        if self._say is not None:
            self._say(f"refused the connection from {self.peer}: {self.refusal}; carrying "
                      "on" if joining else f"dropped the connection from {self.peer}: "
                      f"{self.refusal}")
        if joining:
            try:
                self._sock.settimeout(1.0)
                self._sock.sendall(json.dumps({"refused": "hello"}).encode() + b"\n")
            except OSError:
                pass

    def _write(self):
        while True:
            message = self._outbox.get()
            if message is None:
                return
            self._sending_since = time.monotonic()
            try:
                self._sock.sendall(self._seal.seal(message))
            except OSError:
                self.closed = True
                return
            finally:
                self._sending_since = None
                self._outbox.task_done()

    def send(self, message: Message | dict, text: bytes | None = None) -> bool:
        """Queue ``message`` (protocol.py's, or its wire form); never blocks. False when
        the link is closed. ``text``: its encoding, made once for many links
        (:func:`broadcast`)."""
        if self.closed:
            return False
        # the text as it is now (callers may change the dict later); the writer signs it
        self._outbox.put(encode(message) if text is None else text)
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
        self._drop()

    def _drop(self) -> None:
        self._outbox.put(None)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def silent_for(self) -> float:
        """Seconds since the last message: a machine that vanished closes nothing."""
        return time.monotonic() - self.last_heard


def encode(message: Message | dict) -> bytes:
    """The JSON text of ``message`` (protocol.py's, or its wire form)."""
    return json.dumps(message.to_wire() if isinstance(message, Message)
                      else message).encode()


def broadcast(links, message: Message | dict) -> None:
    """Send ``message`` over every one of ``links``, encoded once: a round's spec lists
    every node, and encoding it for each made the host's cost grow with the square of
    the nodes (each link still signs it with its own key)."""
    text = encode(message)
    for link in links:
        link.send(message, text)


class Beating:
    """While in the ``with`` block, a thread sends ``message`` over ``links`` every
    ``every`` seconds: a launcher stays heard from while it does something slow (ending
    its processes: SIGTERM, then SIGKILL after a grace)."""

    def __init__(self, links: list[Link], every: float, message: Message):
        self._links, self._every, self._message = links, every, message
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._done.wait(self._every):
            broadcast(self._links, self._message)

    def __enter__(self) -> Beating:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()


class JoinError(RuntimeError):
    """A node did not join the job in time."""


def listen_address(master_addr: str | None) -> str:
    """The address node 0's launcher listens on: --master-addr's when it is an address
    of this machine, so that only the interface that carries the job answers; else
    every interface (''). A name that resolves to a loopback address here is not
    trusted: the other nodes may resolve it to this machine's real address."""
    if not master_addr:
        return ""
    try:
        addr = socket.gethostbyname(master_addr)
        literal = ipaddress.ip_address(master_addr) is not None
    except OSError:
        return ""
    except ValueError:
        literal = False
    if ipaddress.ip_address(addr).is_loopback and not literal:
        return ""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((addr, 0))
    except OSError:
        return ""
    return addr


class Listener:
    """Node 0's door for the other nodes' launchers: ``poll`` hands over each new
    connection whose hello authenticated with the job's ``secret`` and drops (and
    ``say``s) any other. A static job closes it once every node has joined; an elastic
    job keeps it open for nodes that join later.

    At most ``half_open`` connections are served at once before their hello; the kernel
    holds the others (up to ``backlog`` of the job's nodes besides) until a place frees:
    strangers that connect and say nothing hold no more than that, and a burst of the
    job's own launchers is served as fast as their hellos come in."""

    def __init__(self, port: int, secret: str, say, bind_addr: str = "", backlog: int = 8,
                 half_open: int = HALF_OPEN_LIMIT):
        self.port, self._secret, self._say = port, secret, say
        self._half_open = half_open
        self._server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._server.bind((bind_addr, port))
        except OSError as err:
            self._server.close()
            raise JoinError(f"cannot listen on {bind_addr or '*'}:{port} for the other "
                            f"nodes' launchers: {err}; choose another --master-port") from err
        self.port = self._server.getsockname()[1]     # port 0: the one given
        self._server.listen(backlog + half_open)
        self._server.settimeout(0.0)
        self._pending: list[Link] = []
        self._kept: list[tuple[Link, dict]] = []
        self._queued = False    # the last poll left connections in the kernel's queue

    @property
    def arriving(self) -> int:
        """Connections on their way in: those that have not said hello yet, and one more
        while others may wait in the kernel's queue."""
        return len(self._pending) + self._queued

    def keep(self, link: Link, hello: dict) -> None:
        """Hand ``link`` (and its ``hello``) out again at the next ``poll``."""
        self._kept.append((link, hello))

    def poll(self) -> list[tuple[Link, dict]]:
        """The connections that said an authenticated hello since the last call (and
        those kept); then as many new connections as there is room for are challenged."""
        hellos, self._kept = self._kept, []
        for link in list(self._pending):
            hello = self._hello(link)
            if hello is not False:
                self._pending.remove(link)
                if hello is not None:
                    hellos.append((link, hello))
        while len(self._pending) < self._half_open:
            link = _accept(self._server, self._secret, self._say)
            if link is None:
                self._queued = False
                break
            self._pending.append(link)
        else:
            self._queued = True
        return hellos

    def _hello(self, link: Link) -> dict | None | bool:
        """The hello of a pending ``link``; None when the link is done without one
        (dropped, said); False while it may still come."""
        try:
            hello = link.inbox.get_nowait()
        except queue.Empty:
            if time.monotonic() - link.opened_at <= HANDSHAKE_TIMEOUT:
                return False
            link.close(flush=0)
            self._say(f"dropped the connection from {link.peer}: no hello within "
                      f"{HANDSHAKE_TIMEOUT:g} s; carrying on")
            return None
        if hello is None and link.refusal is None:
            self._say(f"the connection from {link.peer} closed before its hello; "
                      "carrying on")
        return hello

    def close(self) -> None:
        self._server.close()
        for link in self._pending + [link for link, _ in self._kept]:
            link.close(flush=0)
        self._pending.clear()
        self._kept.clear()


def refuse(link: Link, report: str, status: int = 2) -> None:
    """Tell a launcher that joined why it cannot take part (or no longer), and close
    its link; it exits with ``status``."""
    link.send(End(status, False, report))
    link.close()


def accept_nodes(port: int, nnodes: int, timeout: float, say, secret: str,
                 bind_addr: str = "", half_open: int = HALF_OPEN_LIMIT,
                 heartbeat: float = HEARTBEAT) -> dict[int, tuple[Link, dict]]:
    """Node 0: wait for the launchers of nodes 1..nnodes-1 to connect and say hello
    signed with the job's ``secret``, and welcome each; drop (and ``say``) any other
    connection. A node that joins again (its first link closed) replaces its old link.
    The nodes that joined hear a Tick every ``heartbeat`` seconds meanwhile: a job whose
    nodes arrive over more than --silence-limit lost its first ones before."""
    listener = Listener(port, secret, say, bind_addr, nnodes, half_open)
    deadline = time.monotonic() + timeout
    joined: dict[int, tuple[Link, dict]] = {}
    next_tick = 0.0
    try:
        while len(joined) < nnodes - 1:
            if time.monotonic() >= next_tick:
                next_tick = time.monotonic() + heartbeat
                broadcast([link for link, _ in joined.values()], Tick())
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
            for link, hello in listener.poll():
                node = hello.get("node")
                again = node in joined and joined[node][0].closed
                if (node in joined and not again) or not isinstance(node, int) \
                        or not 0 < node < nnodes:
                    refusal = (f"node rank {node} is taken or out of range [1, {nnodes}); "
                               "give each machine its own --node-rank")
                    say(f"refused node {node} ({hello.get('host')}) at {link.peer}: "
                        f"{refusal}")
                    refuse(link, refusal)
                    continue
                joined[node] = (link, hello)
                link.send(Welcome())
                say(f"node {node} ({hello['host']}) joined "
                    + ("again: its first connection closed" if again else
                       f"({len(joined) + 1} of {nnodes} nodes)"))
            time.sleep(0.05)
    finally:
        listener.close()
    return joined


def _accept(server: socket.socket, secret: str, say) -> Link | None:
    """The next connection, sent its challenge; None when there is none yet."""
    try:
        sock, (host, port) = server.accept()
    except (BlockingIOError, TimeoutError):
        return None
    challenge = secrets.token_hex(16)
    try:
        sock.settimeout(HANDSHAKE_TIMEOUT)
        sock.sendall(json.dumps({"dist_gluon": "launcher", "challenge": challenge})
                     .encode() + b"\n")
        sock.settimeout(None)
    except OSError:
        sock.close()
        return None
    return Link(sock, _Seal(secret, challenge, "m"), f"{host}:{port}", say)


class Backoff:
    """The waits between a launcher's attempts to join: growing from ``first`` to at
    most ``cap`` seconds, each drawn from [0.5, 1.5) times that, so that launchers
    started together (srun) do not all come back together."""

    def __init__(self, first: float = 0.1, cap: float = 2.0, rng: random.Random | None = None):
        self.first, self.cap = first, cap
        self.attempts = 0
        self._rng = rng or random.Random()

    def next(self) -> float:
        """The wait before the next attempt."""
        base = min(self.cap, self.first * 2 ** self.attempts)
        self.attempts += 1
        return base * self._rng.uniform(0.5, 1.5)


def connect_to_master(addr: str, port: int, hello: dict, timeout: float, secret: str,
                      say=None, backoff: Backoff | None = None,
                      deadline: float | None = None) -> Link:
    """Nodes 1..M-1: connect to node 0's launcher and answer its challenge with ``hello``
    signed with the job's ``secret``; while that fails (node 0 not listening yet, or too
    busy to answer), try again after ``backoff``'s waits until ``timeout`` seconds have
    passed (or until the monotonic ``deadline`` of a join that began earlier), and
    ``say`` each new reason once."""
    deadline = time.monotonic() + timeout if deadline is None else deadline
    backoff = backoff or Backoff()
    last_error = told = None
    while True:
        try:
            return _handshake(addr, port, hello, secret, deadline)
        except _NotYet as err:
            last_error = str(err)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        if say is not None and last_error != told:
            told = last_error
            say(f"not admitted yet: cannot join the job's host at {addr}:{port} "
                f"({last_error}); retrying until --join-timeout")
        time.sleep(min(backoff.next(), remaining))
    raise JoinError(f"cannot reach the master launcher at {addr}:{port} within "
                    f"--join-timeout {timeout:g} s ({last_error}); start node 0 with the "
                    "same --master-addr/--master-port, and check the address is reachable "
                    "from this machine")


class _NotYet(Exception):
    """Why one attempt to join failed, when it may pass."""


def _handshake(addr: str, port: int, hello: dict, secret: str, deadline: float) -> Link:
    """One attempt: connect, read the challenge, send the signed hello."""
    limit = max(0.1, min(HANDSHAKE_TIMEOUT, deadline - time.monotonic()))
    try:
        sock = socket.create_connection((addr, port), timeout=min(5.0, limit))
    except OSError as err:
        raise _NotYet(err.strerror or str(err) or type(err).__name__) from None
    try:
        sock.settimeout(limit)
        challenge = _read_challenge(sock)
        seal = _Seal(secret, challenge, "n")
        sock.sendall(seal.seal_hello(dict(hello, nonce=secrets.token_hex(16))))
        sock.settimeout(None)
    except TimeoutError:
        sock.close()
        raise _NotYet(f"connected, but no challenge came within {limit:g} s: node 0 is "
                      "busy with other launchers") from None
    except (OSError, ValueError) as err:
        sock.close()
        raise _NotYet(f"no dist_gluon launcher answered there: {err}") from None
    return Link(sock, seal, f"{addr}:{port}")


def _read_challenge(sock: socket.socket) -> str:
    """Node 0's first line, read byte by byte (the Link reads what follows)."""
    line = b""
    while not line.endswith(b"\n"):
        byte = sock.recv(1)
        if not byte:
            raise ValueError("the connection closed before a challenge")
        line += byte
        if len(line) > 1024:
            raise ValueError("its first line is not a challenge")
    try:
        greeting = json.loads(line)
    except RecursionError:
        raise ValueError("its first line is not a challenge") from None
    if not isinstance(greeting, dict) or greeting.get("dist_gluon") != "launcher" \
            or not isinstance(greeting.get("challenge"), str):
        raise ValueError("its first line is not a challenge")
    return greeting["challenge"]
