"""The Gloo rendezvous of a horovod job: a small HTTP key-value store, stdlib only.

Horovod's Gloo workers (``horovod/common/gloo/http_store.cc``, horovod 0.28.1) find each
other through an HTTP server at ``HOROVOD_GLOO_RENDEZVOUS_ADDR:HOROVOD_GLOO_RENDEZVOUS_PORT``
and use nothing but three requests on ``/<scope>/<key>``:

``PUT``
    store the body under (scope, key); answered 200.
``GET``
    200 with the stored bytes, or 404 while the key does not exist. A worker waiting for
    a peer polls every 10 ms until its ``HOROVOD_GLOO_TIMEOUT_SECONDS`` (default 30) ends.
``DELETE``
    sent once per scope by each rank (key = its rank) after the scope's barrier, when
    every peer has read every address; answered 200.

Scopes are ``global``, ``local_<HOROVOD_HOSTNAME>`` and ``cross_<local rank>``, then the
same three with ``_process_set_hash_<hex>`` appended for the global process set; each
holds the keys ``rank_<i>`` (rank i's machine name, read once without waiting: a 404
counts as an empty name) and ``<i>`` (rank i's addresses, waited for). Any status other
than 200 or 404, or a refused connection, is retried.
Static workers query nothing else: horovod's ``RendezvousServer.init(host_alloc_plan)``
only tells its server when a scope is complete so that it can drop it, and the
``rank_and_size`` scope is read by elastic jobs alone. Here a DELETE removes the key it
names (and the scope once empty), which is safe because it comes after the barrier.

Only the job's own workers get in. The C++ client cannot sign a request, but it builds
every URL as ``http://`` + ``HOROVOD_GLOO_RENDEZVOUS_ADDR`` + ``:`` + port + ``/`` +
scope + ``/`` + key and parses the host and port from the text before the first ``/``:
given the address ``<addr>:<port>/<token>`` (see ``rendezvous_token`` in
:func:`dist_gluon.launch.jobenv.horovod_worker_env`) it sends ``/<token>:<port>/<scope>/<key>``.
A server made with a ``token`` (unguessable, derived from the job secret) answers 403 to
any request whose path does not start with it, and reports the first such request from
each address.

The C++ client connects over IPv4 only, sends one request per connection and gives up
after 3 failed attempts 500 ms apart: start the server before any worker, and have the
launchers of other nodes check that it is reachable before they start theirs.
"""
from __future__ import annotations

import hmac
import socketserver
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler

# A worker that stops sending mid-request must not hold a server thread forever.
_REQUEST_TIMEOUT = 10
# How often the serving thread checks for stop(); socketserver's 0.5 s would make every
# stop of a job, and so every launcher exit and restart, half a second slower.
_POLL_INTERVAL = 0.05
# Every waiting worker opens a new connection every 10 ms; the listen queue must hold a
# burst from all of them (socketserver's default is 5).
_LISTEN_BACKLOG = 1024


class _Handler(BaseHTTPRequestHandler):
    timeout = _REQUEST_TIMEOUT
    # HTTP/1.0: the server closes the connection after each answer, as the client expects.
    protocol_version = "HTTP/1.0"

    def do_GET(self) -> None:
        address = self._address()
        if address is None:
            return
        value = self.server.store.get(*address)
        if value is None:
            self._answer(HTTPStatus.NOT_FOUND)
        else:
            self._answer(HTTPStatus.OK, value)

    def do_PUT(self) -> None:
        address = self._address()
        if address is None:
            return
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self._answer(HTTPStatus.LENGTH_REQUIRED)
            return
        value = self.rfile.read(int(length))
        if len(value) != int(length):
            self._answer(HTTPStatus.BAD_REQUEST)
            return
        self.server.store.put(*address, value)
        self._answer(HTTPStatus.OK)

    def do_DELETE(self) -> None:
        address = self._address()
        if address is None:
            return
        self.server.store.delete(*address)
        self._answer(HTTPStatus.OK)

    def _address(self) -> tuple[str, str] | None:
        parts = self.path.split("/")
        token = self.server.token
        if token is not None:
            if len(parts) != 4 or parts[0] != "" or not hmac.compare_digest(
                    parts[1].split(":")[0].encode(), token.encode()):
                self.server.refused(self.client_address[0], self.command)
                self._answer(HTTPStatus.FORBIDDEN)
                return None
            del parts[1]
        if len(parts) != 3 or parts[0] != "":
            self._answer(HTTPStatus.BAD_REQUEST)
            return None
        return parts[1], parts[2]

    def _answer(self, status: HTTPStatus, body: bytes = b"") -> None:
        self.send_response(status)
        # The C++ client matches this header name case-sensitively and, without it,
        # stops reading after the first packet of the body.
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args) -> None:
        pass


class _Store:
    """Scopes of keys of bytes, shared by the server's request threads."""

    def __init__(self):
        self._lock = threading.Lock()
        self._scopes: dict[str, dict[str, bytes]] = {}

    def get(self, scope: str, key: str) -> bytes | None:
        with self._lock:
            return self._scopes.get(scope, {}).get(key)

    def put(self, scope: str, key: str, value: bytes) -> None:
        with self._lock:
            self._scopes.setdefault(scope, {})[key] = value

    def delete(self, scope: str, key: str) -> None:
        with self._lock:
            keys = self._scopes.get(scope)
            if keys is not None:
                keys.pop(key, None)
                if not keys:
                    del self._scopes[scope]

    def keys(self, scope: str) -> list[str]:
        with self._lock:
            return sorted(self._scopes.get(scope, {}))

    def clear(self) -> None:
        with self._lock:
            self._scopes.clear()


class _Server(socketserver.ThreadingMixIn, socketserver.TCPServer):
    # A plain TCPServer, not http.server.HTTPServer: that one looks up the fully
    # qualified name of the bind address, which can take seconds without DNS.
    allow_reuse_address = True
    daemon_threads = True
    request_queue_size = _LISTEN_BACKLOG

    def __init__(self, address: tuple[str, int], store: _Store, token: str | None,
                 on_refused):
        self.store, self.token, self._on_refused = store, token, on_refused
        self._refused_from: set[str] = set()
        self._refused_lock = threading.Lock()
        super().__init__(address, _Handler)

    def refused(self, host: str, method: str) -> None:
        with self._refused_lock:
            first = host not in self._refused_from
            self._refused_from.add(host)
        if first and self._on_refused is not None:
            self._on_refused(f"the Gloo rendezvous refused a {method} request from {host} "
                             "without this job's token (further ones from there are "
                             "refused silently); carrying on")

    def handle_error(self, request, client_address) -> None:
        # A worker killed mid-request resets its connection; that is not news.
        pass


class GlooRendezvous:
    """The key-value server that the Gloo workers of one horovod job meet at.

    Node 0's launcher runs it on the master address; every worker of the job gets its
    address and port in ``HOROVOD_GLOO_RENDEZVOUS_ADDR`` and ``HOROVOD_GLOO_RENDEZVOUS_PORT``
    (see :func:`dist_gluon.launch.jobenv.horovod_worker_env`). It serves requests on its own
    threads and logs nothing.

    Keys left behind by workers that died mid-rendezvous would send the next attempt's
    workers to dead addresses, so call :meth:`reset` (or start a new server) before
    restarting a job, once every worker of the previous attempt has ended.

    Parameters
    ----------
    bind_addr : str
        IPv4 address to listen on; the default listens on every interface.
    port : int
        TCP port, 0 for one the system picks (see the return value of :meth:`start`).
    token : str, optional
        When given, only requests whose path starts with ``/<token>`` are served (the
        workers' ``rendezvous_token``); others get 403. Letters and digits only.
    on_refused : callable, optional
        Called with one line of text the first time a request from an address is
        refused (from a server thread).

    Examples
    --------
    >>> from dist_gluon.launch.jobenv import horovod_worker_env, worker_layout
    >>> with GlooRendezvous("0.0.0.0", 0) as rendezvous:
    ...     envs = [horovod_worker_env("127.0.0.1", rendezvous.port, "lo", "localhost",
    ...                                **worker_layout([2], 0, r)._asdict())
    ...             for r in range(2)]
    ...     # start two workers, one with each env, and wait for them
    """

    def __init__(self, bind_addr: str = "0.0.0.0", port: int = 0,
                 token: str | None = None, on_refused=None):
        if not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an integer in [0, 65535], got {port!r}")
        if token is not None and not (token.isascii() and token.isalnum()):
            raise ValueError(f"token must be a non-empty string of letters and digits, "
                             f"got {token!r}")
        self._token, self._on_refused = token, on_refused
        self._bind_addr = bind_addr
        self._requested_port = port
        self._store = _Store()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> int:
        """Listen and serve in a background thread; returns the port."""
        if self._server is not None:
            raise RuntimeError("this GlooRendezvous is already running")
        self._server = _Server((self._bind_addr, self._requested_port), self._store,
                               self._token, self._on_refused)
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        args=(_POLL_INTERVAL,), name="gloo-rendezvous",
                                        daemon=True)
        self._thread.start()
        return self.port

    def stop(self) -> None:
        """Stop serving and close the listening socket (the port can be bound again at
        once). Does nothing if not running."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
        self._server = self._thread = None

    def reset(self) -> None:
        """Forget every key, as a fresh server would (between attempts of a job)."""
        self._store.clear()

    @property
    def port(self) -> int:
        """The port the running server listens on."""
        if self._server is None:
            raise RuntimeError("this GlooRendezvous is not running: call start() first")
        return self._server.server_address[1]

    def keys(self, scope: str) -> list[str]:
        """The keys present in ``scope``, sorted (``keys('global')`` shows which ranks
        have announced themselves so far)."""
        return self._store.keys(scope)

    def __enter__(self) -> GlooRendezvous:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()
