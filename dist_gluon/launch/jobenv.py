"""What the launcher must know about each backend's job environment, stdlib only.

The launcher imports neither mxnet nor horovod (it must start in well under a second), so
the environment variables that start a horovod or ps-lite worker, and the network facts
they depend on, live here as pure functions returning ``{name: value}`` dicts.

Horovod over Gloo (horovod 0.28.1, ``horovod/common/gloo/gloo_context.cc``)
--------------------------------------------------------------------------
A static Gloo worker reads ``HOROVOD_CONTROLLER`` and ``HOROVOD_CPU_OPERATIONS`` (``gloo``:
a build with MPI would otherwise default to MPI), ``HOROVOD_GLOO_RENDEZVOUS_ADDR`` and
``_PORT`` (without them it runs alone), ``HOROVOD_RANK``/``SIZE``/``LOCAL_RANK``/
``LOCAL_SIZE``/``CROSS_RANK``/``CROSS_SIZE`` (each defaults to a one-process job), and
builds three contexts at the rendezvous, then the same three again for the global process
set:

- *global*, *local* (scope ``local_<HOROVOD_HOSTNAME>``) and *cross* (scope
  ``cross_<local rank>``) bind the address of ``HOROVOD_GLOO_IFACE``: its first address,
  which peers on other nodes must be able to reach. Unset, it would be the address of
  the machine's host name, as below.
- the process-set contexts are created with no interface at all (horovod does not pass
  ``HOROVOD_GLOO_IFACE`` on), so Gloo binds the first address that the machine's own host
  name (``gethostname()``, not ``HOROVOD_HOSTNAME``) resolves to. Where that is a loopback
  address (Debian's ``127.0.1.1 <name>`` line, a container's ``127.0.0.1 <name>``),
  workers on other nodes dial 127.x and the job aborts; no variable can fix it, only
  name resolution (see :func:`resolves_to_loopback`).

``HOROVOD_HOSTNAME`` is therefore only a label: it names the local scope, so it must be
the same for the workers of one node and differ between nodes (two nodes with one label
would mix their local ranks in one scope); it is never resolved. horovodrun passes the
host names of ``-H``. ``HOROVOD_GLOO_TIMEOUT_SECONDS`` (default 30) bounds how long a
rank waits for its peers at each scope.

ps-lite (``dist_sync`` and P3; the ps-lite of MXNet 1.9.1, ``src/van.cc``, ``zmq_van.h``)
----------------------------------------------------------------------------------------
- The scheduler binds ``tcp://DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT`` itself, and ZeroMQ
  binds numeric addresses only: ``DMLC_PS_ROOT_URI=localhost`` fails with "bind failed"
  (checked with mxnet 1.9.1). So it is node 0's IPv4 address as the other nodes reach
  it (``DMLC_USE_KUBERNETES=1`` would make the scheduler bind 0.0.0.0 instead).
- Servers and workers announce, and bind, ``DMLC_NODE_HOST`` when it is set, verbatim.
  Unset, they take the IPv4 address of ``DMLC_INTERFACE``, or else of the first
  non-loopback interface in ``getifaddrs`` order, which on a host with several networks
  (docker0, a management network) may not be the one the other nodes reach. The launcher
  therefore always sets ``DMLC_NODE_HOST`` to :func:`route_source_addr` of the master:
  a numeric, local address on the network the scheduler is on.
- Their port is random (10000-50000, up to 40 tries) unless ``PORT`` is set.
- ``DMLC_LOCAL=1`` replaces TCP with ``ipc:///tmp/<port>`` and only works on one host;
  ``PS_VERBOSE=1`` (or 2) logs binds and connections, which helps to debug multi-host
  jobs; ``PS_HEARTBEAT_INTERVAL``/``_TIMEOUT`` and ``PS_RESEND`` are off by default.
- ``DMLC_PS_VAN_TYPE=p3`` selects the P3 van (a ZeroMQ van: the same addressing and
  wire). It sends from a priority queue in which messages of equal priority leave in any
  order, and its Stop queues the TERMINATE that ends its sending thread behind whatever
  is still queued. The scheduler, which sends only control messages, therefore runs the
  plain ZeroMQ van (:func:`scheduler_env`): on the P3 van its replies to the final
  barrier could be dropped, leaving every worker and server in ``ps::Finalize`` forever.
"""
from __future__ import annotations

import fcntl
import ipaddress
import re
import socket
import struct
import subprocess
from typing import NamedTuple

_ROLES = ("scheduler", "server", "worker")
# Characters that would break the URL path /local_<hostname>/<key> of the rendezvous.
_UNSAFE_LABEL = re.compile(r"[\s/?#%]")
_SIOCGIFADDR = 0x8915


class WorkerLayout(NamedTuple):
    """Where one worker sits in the job: horovod's ``SlotInfo`` without the host."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int


def worker_layout(slots_per_node: list[int], node_rank: int, local_rank: int) -> WorkerLayout:
    """The ranks of worker ``local_rank`` of node ``node_rank``, as horovodrun assigns them.

    Ranks are numbered node by node (with N workers on every node, rank = node_rank * N +
    local_rank). The cross communicator of local rank ``l`` holds local rank ``l`` of every
    node that has more than ``l`` workers.

    Parameters
    ----------
    slots_per_node : list of int
        Number of workers on each node, in node-rank order.
    node_rank : int
        Index into ``slots_per_node``.
    local_rank : int
        In ``[0, slots_per_node[node_rank])``.

    Examples
    --------
    >>> worker_layout([2, 2], node_rank=1, local_rank=0)
    WorkerLayout(rank=2, size=4, local_rank=0, local_size=2, cross_rank=1, cross_size=2)
    """
    if not slots_per_node or any(n < 1 for n in slots_per_node):
        raise ValueError(f"slots_per_node must be a non-empty list of positive worker counts, "
                         f"got {slots_per_node!r}")
    if not 0 <= node_rank < len(slots_per_node):
        raise ValueError(f"node_rank must be in [0, {len(slots_per_node)}), got {node_rank}")
    local_size = slots_per_node[node_rank]
    if not 0 <= local_rank < local_size:
        raise ValueError(f"local_rank must be in [0, {local_size}) on node {node_rank}, "
                         f"got {local_rank}")
    return WorkerLayout(
        rank=sum(slots_per_node[:node_rank]) + local_rank,
        size=sum(slots_per_node),
        local_rank=local_rank,
        local_size=local_size,
        cross_rank=sum(1 for n in slots_per_node[:node_rank] if n > local_rank),
        cross_size=sum(1 for n in slots_per_node if n > local_rank),
    )


def horovod_worker_env(rendezvous_addr: str, rendezvous_port: int, iface: str, hostname: str,
                       rank: int, size: int, local_rank: int, local_size: int,
                       cross_rank: int, cross_size: int, *,
                       timeout_seconds: int | None = None,
                       rendezvous_token: str | None = None) -> dict[str, str]:
    """The ``HOROVOD_*`` variables that make a process one static Gloo worker of a job.

    Parameters
    ----------
    rendezvous_addr : str
        IPv4 address (or name) of the :class:`~dist_gluon.launch.rendezvous.GlooRendezvous`, as
        this node reaches it.
    rendezvous_port : int
        Its port.
    iface : str
        Network interface whose address this worker announces to its peers; see
        :func:`gloo_iface`.
    hostname : str
        Label of this worker's node: equal for the workers of a node, different between
        nodes; usually the node's host name. It is not resolved.
    rank, size, local_rank, local_size, cross_rank, cross_size : int
        This worker's place in the job, e.g. from :func:`worker_layout`.
    timeout_seconds : int, optional
        How long a worker waits for its peers at each step of the rendezvous
        (``HOROVOD_GLOO_TIMEOUT_SECONDS``); horovod's default is 30.
    rendezvous_token : str, optional
        The token of a rendezvous that serves only its own job's workers (see
        :class:`~dist_gluon.launch.rendezvous.GlooRendezvous`); it travels in every request's
        path: ``HOROVOD_GLOO_RENDEZVOUS_ADDR`` becomes ``<addr>:<port>/<token>``.

    Examples
    --------
    >>> env = horovod_worker_env("10.0.0.1", 29500, "eth0", "node1",
    ...                          **worker_layout([2, 2], 1, 0)._asdict())
    >>> env["HOROVOD_RANK"], env["HOROVOD_CROSS_RANK"]
    ('2', '1')
    """
    _check_port("rendezvous_port", rendezvous_port)
    if not rendezvous_addr:
        raise ValueError("rendezvous_addr must be the rendezvous server's address, got ''")
    if not iface:
        raise ValueError("iface must name a network interface (e.g. 'eth0', 'lo'), got ''")
    if not hostname or _UNSAFE_LABEL.search(hostname):
        raise ValueError(f"hostname must be a non-empty label without whitespace, '/', '?', "
                         f"'#' or '%' (it becomes part of a URL path), got {hostname!r}")
    for name, value, bound in (("rank", rank, size), ("local_rank", local_rank, local_size),
                               ("cross_rank", cross_rank, cross_size)):
        if not 0 <= value < bound:
            raise ValueError(f"{name} must be in [0, {bound}), got {value}")
    if local_size > size or cross_size > size:
        raise ValueError(f"local_size ({local_size}) and cross_size ({cross_size}) cannot "
                         f"exceed size ({size})")
    if rendezvous_token is not None:
        if not (rendezvous_token.isascii() and rendezvous_token.isalnum()):
            raise ValueError(f"rendezvous_token must be letters and digits, got "
                             f"{rendezvous_token!r}")
        # horovod appends ":<port>/<scope>/<key>" and reads the port before the first "/"
        rendezvous_addr = f"{rendezvous_addr}:{rendezvous_port}/{rendezvous_token}"
    env = {
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": rendezvous_addr,
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(rendezvous_port),
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_IFACE": iface,
        "HOROVOD_HOSTNAME": hostname,
        "HOROVOD_RANK": str(rank),
        "HOROVOD_SIZE": str(size),
        "HOROVOD_LOCAL_RANK": str(local_rank),
        "HOROVOD_LOCAL_SIZE": str(local_size),
        "HOROVOD_CROSS_RANK": str(cross_rank),
        "HOROVOD_CROSS_SIZE": str(cross_size),
    }
    if timeout_seconds is not None:
        if timeout_seconds < 1:
            raise ValueError(f"timeout_seconds must be at least 1, got {timeout_seconds}")
        env["HOROVOD_GLOO_TIMEOUT_SECONDS"] = str(int(timeout_seconds))
    return env


def pslite_env(root_uri: str, root_port: int, num_workers: int, num_servers: int,
               node_host: str, p3: bool) -> dict[str, str]:
    """Environment shared by the scheduler, the servers and the workers of one node.

    Parameters
    ----------
    root_uri : str
        IPv4 address of node 0, where the scheduler listens (ZeroMQ binds numeric
        addresses only).
    root_port : int
        The scheduler's port.
    num_workers, num_servers : int
        Totals over all nodes.
    node_host : str
        IPv4 address of this node that the others reach; servers and workers bind and
        announce it. :func:`route_source_addr` of ``root_uri`` finds it.
    p3 : bool
        Run the P3 van (updates on the workers).
    """
    _check_ipv4("root_uri", root_uri)
    _check_ipv4("node_host", node_host)
    _check_port("root_port", root_port)
    if num_workers < 1 or num_servers < 1:
        raise ValueError(f"a ps-lite job needs at least one worker and one server, got "
                         f"num_workers={num_workers}, num_servers={num_servers}")
    env = {
        "DMLC_PS_ROOT_URI": root_uri,
        "DMLC_PS_ROOT_PORT": str(root_port),
        "DMLC_NODE_HOST": node_host,
        "DMLC_NUM_SERVER": str(num_servers),
        "DMLC_NUM_WORKER": str(num_workers),
    }
    if p3:
        env.update({"DMLC_PS_VAN_TYPE": "p3", "MXNET_UPDATE_ON_KVSTORE": "0"})
    return env


def pslite_role_env(role: str) -> dict[str, str]:
    """``{'DMLC_ROLE': role}`` for ``role`` in 'scheduler', 'server', 'worker'."""
    if role not in _ROLES:
        raise ValueError(f"role must be one of {', '.join(_ROLES)}; got {role!r}")
    return {"DMLC_ROLE": role}


def scheduler_env(common: dict[str, str]) -> dict[str, str]:
    """The scheduler's environment from ``common`` (:func:`pslite_env`): its role, and
    ZeroMQ's plain van even in a P3 job (see the module docstring: on the P3 van its
    replies to the job's final barrier can be lost)."""
    env = {k: v for k, v in common.items() if k != "DMLC_PS_VAN_TYPE"}
    env.update(pslite_role_env("scheduler"))
    return env


def route_iface(dest_addr: str) -> str:
    """The network interface the kernel sends packets for ``dest_addr`` through.

    ``'lo'`` for a loopback address and for this host's own addresses. For the interface
    a node's Gloo workers should announce, use :func:`gloo_iface` instead.
    """
    dest = _ipv4(dest_addr)
    if ipaddress.ip_address(dest).is_loopback or _is_own_address(dest):
        return "lo"
    try:
        out = subprocess.run(["ip", "-o", "route", "get", dest], capture_output=True,
                             text=True, timeout=5, check=True).stdout
        match = re.search(r"\bdev (\S+)", out)
        if match:
            return match.group(1)
    except (OSError, subprocess.SubprocessError):
        pass
    return _proc_route_iface(dest)


def route_source_addr(dest_addr: str) -> str:
    """This host's address that packets to ``dest_addr`` leave from (``dest_addr``
    itself when it is one of this host's). Sends nothing: connecting a UDP socket only
    asks the kernel for a route."""
    dest = _ipv4(dest_addr)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((dest, 9))
        return sock.getsockname()[0]


def addr_iface(addr: str) -> str:
    """The interface that carries ``addr``, an IPv4 address of this host."""
    addr = _ipv4(addr)
    if ipaddress.ip_address(addr).is_loopback:
        return "lo"
    try:
        out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True,
                             text=True, timeout=5, check=True).stdout
        for line in out.splitlines():
            match = re.match(r"\d+:\s+(\S+)\s+inet\s+([\d.]+)/", line)
            if match and match.group(2) == addr:
                return match.group(1)
    except (OSError, subprocess.SubprocessError):
        pass
    for _, name in socket.if_nameindex():
        if _primary_ipv4(name) == addr:
            return name
    raise ValueError(f"{addr} is not an address of this host")


def gloo_iface(master_addr: str) -> str:
    """The interface whose address this node's Gloo workers announce: the one carrying
    the address this node reaches ``master_addr`` from.

    On every node but the master this is the interface that routes to the master. On
    the master itself the route to its own address goes through 'lo', but its workers
    must announce the address the other nodes reach, which is on the interface that
    carries ``master_addr``. A loopback ``master_addr`` (one-node job) gives 'lo'.
    """
    return addr_iface(route_source_addr(master_addr))


def resolves_to_loopback(hostname: str | None = None) -> bool:
    """True when Gloo would bind a loopback address for ``hostname``.

    Gloo binds the first address of ``getaddrinfo(hostname)`` that it can bind; this
    checks the same one. ``hostname`` defaults to this machine's host name, which is the
    one that matters (see the module docstring). Raises ``OSError`` when the name does
    not resolve to any address of this host.
    """
    name = socket.gethostname() if hostname is None else hostname
    return ipaddress.ip_address(_first_bindable_address(name)).is_loopback


def loopback_hostname_error(hostname: str, resolved: str, reachable_addr: str | None = None,
                            node_rank: int | None = None) -> str:
    """The message for a multi-node horovod job on a node whose host name resolves to
    a loopback address (see :func:`resolves_to_loopback`).

    Parameters
    ----------
    hostname : str
        The machine's host name (``socket.gethostname()``).
    resolved : str
        The loopback address it resolves to.
    reachable_addr : str, optional
        The address other nodes reach this node at (e.g. :func:`route_source_addr` of
        the master), suggested for the hosts file.
    node_rank : int, optional
        Named in the message.
    """
    where = "this node" if node_rank is None else f"node {node_rank}"
    addr = reachable_addr or "<this node's address>"
    return (
        f"{where}: the host name {hostname!r} resolves to {resolved}, a loopback address, "
        f"so horovod's Gloo would tell the other nodes to connect to {resolved} and the "
        f"job would abort. Horovod builds its process-set contexts from the machine's "
        f"host name, not from HOROVOD_GLOO_IFACE, so --iface cannot fix this. Make "
        f"{hostname!r} resolve to the address the other nodes reach this node at: fix DNS, "
        f"or in /etc/hosts replace the loopback line for it with\n    {addr} {hostname}\n"
        f"Or use --backend dist_sync or p3, which do not depend on host names.")


def _check_port(name: str, port: int) -> None:
    if not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"{name} must be an integer in [1, 65535], got {port!r}")


def _check_ipv4(name: str, addr: str) -> None:
    try:
        ipaddress.IPv4Address(addr)
    except ValueError:
        raise ValueError(f"{name} must be a numeric IPv4 address (ps-lite's ZeroMQ binds "
                         f"addresses, not host names), got {addr!r}") from None


def _ipv4(host: str) -> str:
    """``host`` (an address or a name) as an IPv4 address string."""
    try:
        return str(ipaddress.IPv4Address(host))
    except ValueError:
        return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]


def _is_own_address(addr: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((addr, 0))
        except OSError:
            return False
        return True


def _first_bindable_address(hostname: str) -> str:
    infos = socket.getaddrinfo(hostname, None, socket.AF_UNSPEC, socket.SOCK_STREAM)
    for family, socktype, proto, _, sockaddr in infos:
        with socket.socket(family, socktype, proto) as sock:
            try:
                sock.bind((sockaddr[0], 0))
            except OSError:
                continue
            return sockaddr[0]
    raise OSError(f"{hostname!r} resolves to {[info[4][0] for info in infos]}, none of "
                  f"which is an address of this host")


def _proc_route_iface(dest: str, table_path: str = "/proc/net/route") -> str:
    """Longest-prefix match in /proc/net/route (IPv4 main table), where ``ip`` is absent."""
    target = int(ipaddress.IPv4Address(dest))
    best: tuple[int, int, str] | None = None
    with open(table_path) as table:
        next(table)
        for line in table:
            fields = line.split()
            if len(fields) < 8 or not int(fields[3], 16) & 0x1:  # RTF_UP
                continue
            # Addresses are in network byte order, printed as a little-endian host int.
            net = int.from_bytes(bytes.fromhex(fields[1])[::-1], "big")
            mask = int.from_bytes(bytes.fromhex(fields[7])[::-1], "big")
            if target & mask != net:
                continue
            candidate = (bin(mask).count("1"), -int(fields[6]), fields[0])
            if best is None or candidate[:2] > best[:2]:
                best = candidate
    if best is None:
        raise OSError(f"no route to {dest}")
    return best[2]


def _primary_ipv4(iface: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR,
                                 struct.pack("256s", iface.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])
