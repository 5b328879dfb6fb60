"""An emulated cluster on one machine: M hosts as Linux network namespaces on a bridge.

Each host has, like a real machine, its own network stack (a veth pair whose far end is
its ``eth0``, one address of a private /24 that no interface of this machine uses; a
larger subnet for more than 250 hosts), its
own host name (a UTS namespace) and an ``/etc/hosts`` that maps every host's name to its
address (``/etc/netns/<namespace>/hosts``, which ``ip netns exec`` mounts), so a name
never resolves to a loopback address -- Gloo needs that, see ../shared/DESIGN.md.
Optionally each host's link is rate limited (``tc tbf``; netem is absent here) and each
host runs an sshd. Traffic never leaves the machine: the bridge has no address and no
route leads to it. Everything needs root (``skip_reason()`` says why it cannot run).

Names carry a per-cluster tag (``dgc`` and 6 hex digits; host ``i`` and its namespace
are ``<tag>-h<i>``, the bridge ``<tag>-br``), so clusters of concurrent runs never
collide. A cluster is torn down when its ``with`` block ends (also on an exception,
SIGTERM, SIGHUP or interpreter exit); one whose owner process was killed is removed by
the next cluster's start-up or by ``down``.

Usage::

    from emulated_cluster import EmulatedCluster   # with tools/ on sys.path
    with EmulatedCluster(num_hosts=2, rate="1gbit", sshd=True) as cluster:
        host0, host1 = cluster.hosts                # Host(index, name, address, namespace)
        server = cluster.popen(1, ["python3", "-m", "http.server"])
        cluster.run(0, cluster.ssh_argv(1) + ["hostname"])   # ssh clients run on a host
        cluster.partition([0], [1])                 # packets between the groups dropped
        cluster.heal()

    python tools/emulated_cluster.py up --hosts 2 [--rate 1gbit] [--sshd]  # until Ctrl-C
    python tools/emulated_cluster.py down [--all]   # remove dead runs' clusters [or all]

This module uses the standard library only (no mxnet, horovod or dist_gluon).
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import fcntl
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["EmulatedCluster", "Host", "skip_reason", "remove_clusters"]

TAG_PREFIX = "dgc"
_TAG_RE = re.compile(rf"^({TAG_PREFIX}[0-9a-f]{{6}})(?:-|$)")
STATE_ROOT = Path("/run/dist_gluon-emulated-cluster")   # keys, configs, owner records
NETNS_ETC = Path("/etc/netns")
SSH_PORT = 2222   # not 22, so that clients must honour a port option, as on many clusters
SSHD = "/usr/sbin/sshd"
# tbf's burst must hold at least one GSO segment (64 KiB); latency bounds the queue.
TBF_BURST, TBF_LATENCY = "256kb", "50ms"
# a Linux bridge takes at most 1024 ports; a /22 holds 1022 hosts
MAX_HOSTS = 1000
_SUBNET_BASE = ipaddress.ip_network("10.213.0.0/16")   # /24s (or larger) of it are handed out
_RATE_RE = re.compile(r"^\d+(?:\.\d+)?(?:[kmgt]i?)?(?:bit|bps)$", re.IGNORECASE)
_BASE_TOOLS = ("ip", "tc", "nsenter", "unshare", "hostname")
_SSH_TOOLS = ("ssh", "ssh-keygen")
# tc filter preferences of cut links: this plus the index of the host cut off
_CUT_PREF = 1000
_ROUTE_TYPES = ("unicast", "local", "broadcast", "multicast", "throw", "unreachable",
                "prohibit", "blackhole", "nat", "anycast")


@dataclass(frozen=True)
class Host:
    """One emulated host: ``name`` resolves to ``address`` on every host of the cluster."""
    index: int
    name: str
    address: str
    namespace: str


def skip_reason(sshd: bool = False) -> str | None:
    """Why an emulated cluster cannot be created here, or None when it can.

    Parameters
    ----------
    sshd : bool
        Also require what ``EmulatedCluster(sshd=True)`` needs (sshd, ssh, ssh-keygen).
    """
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    missing = [tool for tool in _BASE_TOOLS if shutil.which(tool) is None]
    if sshd:
        missing += [tool for tool in _SSH_TOOLS if shutil.which(tool) is None]
        if not os.access(SSHD, os.X_OK):
            missing.append(SSHD + " (make system-packages installs openssh-server)")
    if missing:
        return "missing " + ", ".join(missing)
    return _namespace_support()


_namespace_support_cache: list[str | None] = []


def _namespace_support() -> str | None:
    if not _namespace_support_cache:
        probe = subprocess.run(["unshare", "--net", "--uts", "true"], capture_output=True,
                               text=True)
        _namespace_support_cache.append(
            None if probe.returncode == 0 else
            f"cannot create network namespaces: {probe.stderr.strip() or probe.returncode}")
    return _namespace_support_cache[0]


class EmulatedCluster:
    """``num_hosts`` emulated hosts on one Linux bridge; a context manager.

    Entering creates the hosts, leaving (also by an exception, SIGTERM or SIGHUP) kills
    every process still running on them and removes every namespace, interface, hosts
    file and key it created.

    Parameters
    ----------
    num_hosts : int
        Number of hosts, 1 to 1000. Host ``i`` has the subnet's address ``i + 1`` (a
        /24 up to 250 hosts, a /23 or /22 beyond).
    rate : str or None
        A tc rate such as ``"1gbit"`` or ``"20mbit"``: each host's link carries at most
        this much in each direction (full duplex, as a NIC on a non-blocking switch), so
        traffic from many hosts into one shares that host's rate. None: unlimited.
    sshd : bool
        Run an sshd on every host (port ``ssh_port``, root may log in with the key
        ``identity_file``). Clients run on a host (``cluster.popen(0, cluster.ssh_argv(1)
        + [...])``), as on a head node: the machine itself has no route to the hosts.

    Examples
    --------
    >>> with EmulatedCluster(num_hosts=2) as cluster:
    ...     out = cluster.run(0, ["getent", "hosts", cluster.hosts[1].name],
    ...                       capture_output=True, text=True).stdout
    """

    def __init__(self, num_hosts: int = 2, rate: str | None = None, sshd: bool = False):
        if not isinstance(num_hosts, int) or not 1 <= num_hosts <= MAX_HOSTS:
            raise ValueError(f"num_hosts must be an int from 1 to {MAX_HOSTS}, "
                             f"got {num_hosts!r}")
        if rate is not None and not (isinstance(rate, str) and _RATE_RE.match(rate)):
            raise ValueError(f"rate must be None or a tc rate such as '1gbit' or '20mbit', "
                             f"got {rate!r}")
        self.num_hosts = num_hosts
        self.rate = rate
        self.sshd = bool(sshd)
        self.tag: str | None = None
        self.subnet: ipaddress.IPv4Network | None = None
        self.hosts: list[Host] = []
        self._state: Path | None = None
        self._processes: list[subprocess.Popen] = []
        self._droppable: list[Host] = []   # hosts whose veth can drop a cut link's packets
        self._lock = threading.RLock()   # a signal handler may close during close()

    # -- life cycle ---------------------------------------------------------------------

    def __enter__(self) -> EmulatedCluster:
        if self.tag is not None:
            raise RuntimeError(f"emulated cluster {self.tag} is already running")
        reason = skip_reason(sshd=self.sshd)
        if reason:
            raise RuntimeError(f"cannot create an emulated cluster: {reason}")
        with _state_lock():
            remove_clusters(stale_only=True)
            self.tag, self.subnet = _new_tag_and_subnet(self.num_hosts)
            _track(self)
            self._state = STATE_ROOT / self.tag
            self._state.mkdir(mode=0o700)
            (self._state / "owner.json").write_text(json.dumps(
                {"pid": os.getpid(), "start": _start_time(os.getpid()),
                 "subnet": str(self.subnet)}))
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Kill the hosts' processes and remove everything the cluster created.
        Idempotent; problems are reported on stderr rather than raised."""
        with self._lock:
            if self.tag is None:
                return
            problems = _teardown(self.tag)
            for process in self._processes:   # reap the killed children
                try:
                    process.wait(timeout=1)
                except subprocess.TimeoutExpired:
                    pass
            self._processes.clear()
            _untrack(self)
            if problems:
                print(f"emulated_cluster: teardown of {self.tag} left: "
                      + "; ".join(problems), file=sys.stderr)
            self.tag = None

    def _create(self) -> None:
        bridge = f"{self.tag}-br"
        try:
            _ip("link", "add", bridge, "type", "bridge", "nf_call_iptables", "0",
                "nf_call_ip6tables", "0", "nf_call_arptables", "0")
        except RuntimeError:   # a kernel without br_netfilter has no such options
            _ip("link", "add", bridge, "type", "bridge")
        _ip("link", "set", bridge, "up")
        self.hosts = [Host(i, f"{self.tag}-h{i}", str(self.subnet.network_address + i + 1),
                           f"{self.tag}-h{i}") for i in range(self.num_hosts)]
        hosts_file = "".join(["127.0.0.1\tlocalhost\n",
                              "::1\tlocalhost ip6-localhost ip6-loopback\n"]
                             + [f"{h.address}\t{h.name}\n" for h in self.hosts])
        (self._state / "uts").mkdir()
        for host in self.hosts:
            ns = host.namespace
            _ip("netns", "add", ns)
            # The root-side end is named like the host; the far end is born in the namespace.
            _ip("link", "add", host.name, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", host.name, "master", bridge, "up")
            _ip("-n", ns, "addr", "add", f"{host.address}/{self.subnet.prefixlen}",
                "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            if self.rate:
                tbf = ["root", "tbf", "rate", self.rate, "burst", TBF_BURST,
                       "latency", TBF_LATENCY]
                _run(["tc", "-n", ns, "qdisc", "add", "dev", "eth0", *tbf])   # host egress
                _run(["tc", "qdisc", "add", "dev", host.name, *tbf])          # host ingress
            (NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / ns / "hosts").write_text(hosts_file)
            uts = self._uts_file(host.index)
            uts.touch()
            _run(["unshare", f"--uts={uts}", "hostname", host.name])
        if self.sshd:
            self._start_sshd()

    def _uts_file(self, index: int) -> Path:
        return self._state / "uts" / f"h{index}"

    # -- running things on hosts ----------------------------------------------------------

    def host_argv(self, i: int, argv: Sequence[str]) -> list[str]:
        """The command line that runs ``argv`` on host ``i`` (its network namespace,
        host name and hosts file), for tools that take a command line."""
        host = self._host(i)
        return [shutil.which("ip") or "ip", "netns", "exec", host.namespace,
                shutil.which("nsenter") or "nsenter", f"--uts={self._uts_file(i)}", "--",
                *argv]

    def popen(self, i: int, argv: Sequence[str], **popen_kwargs) -> subprocess.Popen:
        """Start ``argv`` on host ``i``; ``popen_kwargs`` (env, cwd, stdout, ...) go to
        ``subprocess.Popen``. The returned process is ``argv`` itself (ip and nsenter
        exec into it), and its children stay on the host. The cluster kills it on exit."""
        process = subprocess.Popen(self.host_argv(i, argv), **popen_kwargs)
        self._processes.append(process)
        return process

    def run(self, i: int, argv: Sequence[str], **run_kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` on host ``i`` to completion, as ``subprocess.run``."""
        return subprocess.run(self.host_argv(i, argv), **run_kwargs)

    def _host(self, i: int) -> Host:
        if self.tag is None:
            raise RuntimeError("the emulated cluster is not running (use it in a with block)")
        if not 0 <= i < len(self.hosts):
            raise IndexError(f"host index must be 0 to {len(self.hosts) - 1}, got {i}")
        return self.hosts[i]

    # -- partitions -----------------------------------------------------------------------

    def partition(self, *groups: Sequence[int]) -> None:
        """Cut the network between ``groups`` of hosts (lists of host indices): no
        packet from a host of one group reaches a host of another, both ways, while
        every group's own hosts still reach each other. A real partition: the packets
        are dropped at the bridge, silently (nothing is refused or reset; TCP
        retransmits until it gives up). ``partition([0, 1], [2, 3])``; hosts in no group
        keep every link. Undo with :meth:`heal`."""
        seen: list[int] = []
        for group in groups:
            for i in group:
                self._host(i)
                if i in seen:
                    raise ValueError(f"host {i} is in two groups of {groups!r}")
                seen.append(i)
        for a, group in enumerate(groups):
            for other in groups[a + 1:]:
                for i in group:
                    for j in other:
                        self.cut(i, j)

    def cut(self, a: int, b: int) -> None:
        """Cut the link between hosts ``a`` and ``b`` only, both ways (as a broken
        cable between two switches would: each still reaches every other host)."""
        ha, hb = self._host(a), self._host(b)
        if a == b:
            raise ValueError(f"a host cannot be cut from itself (host {a})")
        for src, dst in ((ha, hb), (hb, ha)):
            self._drop_filters(dst)
            # the root-side end of dst's veth sends what the bridge delivers to dst:
            # packets from src go to the class whose queue holds nothing
            _run(["tc", "filter", "replace", "dev", dst.name, "parent", "1:", "protocol",
                  "ip", "pref", str(_CUT_PREF + src.index), "u32", "match", "ip", "src",
                  f"{src.address}/32", "flowid", "1:2"])

    def heal(self) -> None:
        """Undo every :meth:`partition` and :meth:`cut`: every host reaches every other
        again (a link set down with ``ip link`` stays down)."""
        for host in self._droppable:
            _run(["tc", "filter", "del", "dev", host.name, "parent", "1:"])

    def _drop_filters(self, host: Host) -> None:
        """Give the root-side end of ``host``'s veth an HTB root whose class 1:2 drops
        every packet (a pfifo of no room: this kernel has no tc drop action) and whose
        default class 1:1 passes the rest (through the host's rate limit, if any)."""
        if host in self._droppable:
            return
        dev = host.name
        _run(["tc", "qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb",
              "default", "1"])
        _run(["tc", "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb",
              "rate", "100gbit", "quantum", "200000"])
        _run(["tc", "class", "add", "dev", dev, "parent", "1:", "classid", "1:2", "htb",
              "rate", "1mbit", "quantum", "1514"])
        _run(["tc", "qdisc", "add", "dev", dev, "parent", "1:2", "pfifo", "limit", "0"])
        if self.rate:
            _run(["tc", "qdisc", "add", "dev", dev, "parent", "1:1", "tbf", "rate",
                  self.rate, "burst", TBF_BURST, "latency", TBF_LATENCY])
        self._droppable.append(host)

    # -- ssh ------------------------------------------------------------------------------

    @property
    def ssh_port(self) -> int:
        """The port every host's sshd listens on."""
        self._require_sshd()
        return SSH_PORT

    @property
    def identity_file(self) -> str:
        """The private key root logs in with on every host."""
        self._require_sshd()
        return str(self._state / "id_ed25519")

    def ssh_argv(self, i: int) -> list[str]:
        """``ssh`` options and destination that log in to host ``i``; append the remote
        command. Run it on a host of the cluster (``popen(0, ...)``). The session gets
        sshd's environment, not the caller's: PATH is sshd's default plus what root's
        ~/.bashrc adds, the working directory is root's home."""
        host = self._host(i)
        return ["ssh", "-p", str(self.ssh_port), "-i", self.identity_file,
                "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes", "-o", "LogLevel=ERROR",
                "-o", "ConnectTimeout=10", host.name]

    def _require_sshd(self) -> None:
        if not self.sshd:
            raise RuntimeError("this cluster has no sshd: create it with sshd=True")
        if self.tag is None:
            raise RuntimeError("the emulated cluster is not running (use it in a with block)")

    def _start_sshd(self) -> None:
        state = self._state
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"root@{self.tag}",
              "-f", str(state / "id_ed25519")])
        shutil.copy(state / "id_ed25519.pub", state / "authorized_keys")
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)   # sshd's privilege separation
        daemons = []
        for host in self.hosts:
            key = state / f"sshd-h{host.index}-key"
            _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", host.name,
                  "-f", str(key)])
            config = state / f"sshd-h{host.index}.conf"
            config.write_text(
                f"Port {SSH_PORT}\nHostKey {key}\n"
                f"AuthorizedKeysFile {state / 'authorized_keys'}\n"
                f"PidFile {state / f'sshd-h{host.index}.pid'}\n"
                # StrictModes no: the key files live in /run, not in ~/.ssh.
                "PermitRootLogin yes\nUsePAM no\nStrictModes no\n"
                "PasswordAuthentication no\nKbdInteractiveAuthentication no\n"
                "PrintMotd no\nPrintLastLog no\n")
            with open(state / f"sshd-h{host.index}.log", "wb") as log:
                daemons.append(self.popen(host.index, [SSHD, "-D", "-e", "-f", str(config)],
                                          stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
        for host, daemon in zip(self.hosts, daemons):
            self._wait_listening(host, daemon)

    def _wait_listening(self, host: Host, daemon: subprocess.Popen, timeout: float = 10):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if daemon.poll() is not None:
                break
            listening = subprocess.run(
                ["ip", "netns", "exec", host.namespace, "ss", "-Hltn", f"sport = :{SSH_PORT}"],
                capture_output=True, text=True).stdout
            if listening.strip():
                return
            time.sleep(0.05)
        log = (self._state / f"sshd-h{host.index}.log").read_text(errors="replace")
        raise RuntimeError(f"sshd on {host.name} did not start listening on port {SSH_PORT} "
                           f"(exit status {daemon.poll()}); its log:\n{log}")


# -- discovery and teardown ---------------------------------------------------------------

def _run(argv: Sequence[str]) -> str:
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): "
                           f"{proc.stderr.strip()}")
    return proc.stdout


def _ip(*args: str) -> str:
    return _run(["ip", *args])


def _netns_names() -> list[str]:
    out = _ip("-j", "netns", "list").strip()
    return [entry["name"] for entry in json.loads(out)] if out else []


def _link_names() -> list[str]:
    return [link["ifname"] for link in json.loads(_ip("-j", "link", "show") or "[]")]


def _tags_in_use() -> set[str]:
    names = _netns_names() + _link_names()
    names += [p.name for p in NETNS_ETC.glob(f"{TAG_PREFIX}*")]
    names += [p.name for p in STATE_ROOT.glob(f"{TAG_PREFIX}*")]
    return {m.group(1) for m in map(_TAG_RE.match, names) if m}


def _start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]   # field 22, after the command name


def _owner(tag: str) -> dict | None:
    """The record of the process that created cluster ``tag``, if that process lives."""
    try:
        owner = json.loads((STATE_ROOT / tag / "owner.json").read_text())
    except (OSError, ValueError):
        return None
    return owner if _start_time(owner["pid"]) == owner["start"] else None


@contextlib.contextmanager
def _state_lock():
    """Serialises choosing tags and subnets and removing stale clusters across runs."""
    STATE_ROOT.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(STATE_ROOT / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _new_tag_and_subnet(num_hosts: int = 1) -> tuple[str, ipaddress.IPv4Network]:
    """A fresh tag and a subnet for ``num_hosts`` hosts (a /24, or larger beyond 250)
    that neither this machine's addresses and routes nor another live cluster use.
    Called with the state lock held."""
    prefix = 24
    while num_hosts > 250 and 2 ** (32 - prefix) - 2 < num_hosts:
        prefix -= 1
    in_use = _tags_in_use()
    tag = next(t for t in iter(lambda: TAG_PREFIX + secrets.token_hex(3), None)
               if t not in in_use)
    taken = []
    for line in _ip("-o", "-4", "addr", "show").splitlines():
        taken.append(ipaddress.ip_interface(line.split()[3]).network)
    for line in _ip("-4", "route", "show", "table", "all").splitlines():
        fields = line.split()
        destination = fields[1] if fields[0] in _ROUTE_TYPES else fields[0]
        if destination != "default":
            taken.append(ipaddress.ip_network(destination, strict=False))
    for other in in_use:
        owner = _owner(other)
        if owner:
            taken.append(ipaddress.ip_network(owner["subnet"]))
    candidates = list(_SUBNET_BASE.subnets(new_prefix=prefix))
    start = int(tag[len(TAG_PREFIX):], 16) % len(candidates)
    for subnet in candidates[start:] + candidates[:start]:
        if not any(subnet.overlaps(net) for net in taken):
            return tag, subnet
    raise RuntimeError(f"no free /{prefix} left in {_SUBNET_BASE} for an emulated cluster")


def _kill_namespace_processes(inodes: set[int]) -> list[str]:
    """SIGTERM, then SIGKILL, every process in the network namespaces ``inodes``, also
    those that appear meanwhile; returns the survivors."""
    def pids() -> set[int]:
        found = set()
        for entry in os.scandir("/proc"):
            try:
                if entry.name.isdigit() and os.stat(f"/proc/{entry.name}/ns/net").st_ino in inodes:
                    found.add(int(entry.name))
            except OSError:   # gone meanwhile
                pass
        return found

    remaining = pids() if inodes else set()
    for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 3.0)):
        signalled: set[int] = set()
        deadline = time.monotonic() + grace
        while remaining and time.monotonic() < deadline:
            for pid in remaining - signalled:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            signalled |= remaining
            time.sleep(0.05)
            remaining = pids()
    return [f"process {pid}" for pid in sorted(remaining)]


def _teardown(tag: str) -> list[str]:
    """Remove everything named with ``tag``; returns what could not be removed."""
    prefix = tag + "-"
    problems: list[str] = []

    def attempt(argv):
        try:
            _run(argv)
        except RuntimeError as error:   # something already gone is no problem
            if not any(gone in str(error) for gone in ("Cannot find device", "No such file")):
                problems.append(str(error))

    # Deleting the names first stops new `ip netns exec` entries; each namespace itself
    # lives on until its last process is killed.
    inodes = set()
    for ns in _netns_names():
        if ns.startswith(prefix):
            with contextlib.suppress(OSError):
                inodes.add(os.stat(f"/run/netns/{ns}").st_ino)
            attempt(["ip", "netns", "del", ns])
    problems += _kill_namespace_processes(inodes)
    # Deleting a veth end removes its pair at once; a namespace goes asynchronously.
    for link in _link_names():
        if link.startswith(prefix) and link != f"{tag}-br":
            attempt(["ip", "link", "del", link])
    if f"{tag}-br" in _link_names():
        attempt(["ip", "link", "del", f"{tag}-br"])
    for directory in NETNS_ETC.glob(prefix + "*"):
        shutil.rmtree(directory, ignore_errors=True)
    state = STATE_ROOT / tag
    for uts in state.glob("uts/*"):
        if subprocess.run(["umount", str(uts)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(uts)], capture_output=True)
    shutil.rmtree(state, ignore_errors=True)   # the owner record goes last
    if state.exists():
        problems.append(f"directory {state}")
    return problems


def remove_clusters(stale_only: bool = True) -> list[str]:
    """Tear down the clusters whose creating process has died (all clusters when
    ``stale_only`` is False, including other runs' live ones); returns their tags."""
    removed = []
    for tag in sorted(_tags_in_use()):
        if stale_only and _owner(tag):
            continue
        problems = _teardown(tag)
        if problems:
            print(f"emulated_cluster: teardown of {tag} left: " + "; ".join(problems),
                  file=sys.stderr)
        removed.append(tag)
    return removed


# -- teardown when the owner is terminated ------------------------------------------------

_live: list[EmulatedCluster] = []
_previous_handlers: dict[int, object] = {}
_HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _track(cluster: EmulatedCluster) -> None:
    if not _live and threading.current_thread() is threading.main_thread():
        for sig in _HANDLED_SIGNALS:
            _previous_handlers[sig] = signal.signal(sig, _on_signal)
    _live.append(cluster)


def _untrack(cluster: EmulatedCluster) -> None:
    if cluster in _live:
        _live.remove(cluster)
    if not _live and threading.current_thread() is threading.main_thread():
        _restore_handlers()


def _restore_handlers() -> None:
    for sig, previous in _previous_handlers.items():
        if signal.getsignal(sig) is _on_signal:
            signal.signal(sig, previous)
    _previous_handlers.clear()


def _close_all() -> None:
    for cluster in list(_live):
        cluster.close()


def _on_signal(signum, frame) -> None:
    """Tear down, then let the signal do what it did before (by default: terminate)."""
    previous = _previous_handlers.get(signum, signal.SIG_DFL)
    _close_all()
    _restore_handlers()
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


atexit.register(_close_all)


# -- command line -------------------------------------------------------------------------

def _up(args: argparse.Namespace) -> int:
    with EmulatedCluster(num_hosts=args.hosts, rate=args.rate, sshd=args.sshd) as cluster:
        tag = cluster.tag
        print(f"emulated cluster {cluster.tag}: {cluster.num_hosts} hosts on "
              f"{cluster.subnet}, rate {cluster.rate or 'unlimited'}")
        for host in cluster.hosts:
            print(f"  host {host.index}: {host.name} {host.address}")
        print("a shell on host 0:  " + " ".join(cluster.host_argv(0, ["bash"])))
        if cluster.sshd:
            print("ssh to host 1 (from a host):  " + " ".join(cluster.ssh_argv(
                min(1, cluster.num_hosts - 1))))
        print("Ctrl-C tears it down.", flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass
    print(f"emulated cluster {tag} torn down")
    return 0


def _down(args: argparse.Namespace) -> int:
    reason = skip_reason()
    if reason:
        print(f"emulated_cluster: {reason}", file=sys.stderr)
        return 1
    with _state_lock():
        removed = remove_clusters(stale_only=not args.all)
    print("removed: " + (" ".join(removed) if removed else "nothing"))
    return 1 if _tags_in_use() & set(removed) else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="create a cluster and keep it until Ctrl-C")
    up.add_argument("--hosts", type=int, default=2, help="number of hosts (default 2)")
    up.add_argument("--rate", help="per-host link rate in each direction, e.g. 1gbit")
    up.add_argument("--sshd", action="store_true", help="run an sshd on every host")
    down = commands.add_parser("down", help="remove clusters whose creating process died")
    down.add_argument("--all", action="store_true",
                      help="remove every emulated cluster, also those of runs still going "
                           "(other engineers' or CI's test runs on this machine fail then)")
    args = parser.parse_args(argv)
    try:
        return {"up": _up, "down": _down}[args.command](args)
    except (RuntimeError, ValueError) as error:
        print(f"emulated_cluster: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
