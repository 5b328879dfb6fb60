"""``--backend horovod --transport mpi``: horovod's collectives over MPI, the ranks
started by OpenMPI's ``mpirun``, every launcher feature kept.

Node 0's launcher runs one ``mpirun`` for the whole job; mpirun starts
``mpi_rank.py COMMAND`` once per rank (on other nodes through its own ssh launch, see
below), and that shim runs COMMAND as the MPI rank with dist_gluon's variables
(``DG_RANK`` = the MPI rank). Each node's launcher still watches its own ranks as it
does with Gloo, through what the shim leaves in the node's job-control directory:

- ``rank<R>.rec`` (made before mpirun starts): progress, exceptions, the exit verdict,
  and the pid that receives the stall watchdog's stack request;
- ``rank<R>.out`` / ``rank<R>.err``: named pipes the rank writes its output to, relayed
  here with the ``[R]`` prefix (the last stderr lines feed the failure report);
- ``rank<R>.pid`` / ``rank<R>.exit``: the rank's pid, then its exit status.

So a rank here (:class:`Rank`) looks to the rest of the launcher like a child process
(:class:`~dist_gluon.launch.processes.Process`): the supervisor judges MPI ranks exactly
as Gloo workers, and ``--timeout``, ``--max-restarts`` and the stall watchdog are
unchanged. mpirun runs with ``orte_abort_on_non_zero_status 0``: the launcher, not
mpirun, decides when a failed rank ends the job, so the report names the first rank to
leave. Ending the job stops mpirun and every rank's process group; a rank also dies with
its shim, and a shim ends its rank when mpirun goes away.

Several nodes: the node launchers meet as with Gloo (``--nnodes``/``-H``/SLURM), then
node 0's mpirun starts the other nodes' ranks over ssh (``mpirun -H``; plm_rsh with
``--ssh-port``/``--ssh-identity-file``), so node 0 needs passwordless ssh to every
node's host name, as for ``-H``. A rank finds its node launcher's directory through a
link named after the job (``DG_MPI_CONTROL``), the same name on every node.

This module imports neither mxnet nor horovod.
"""
from __future__ import annotations

import collections
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from .. import jobcontrol
from . import output, ssh
from .config import LaunchConfig
from .processes import TAIL_LINES, Process
from .protocol import RoundSpec

MPIRUN = "mpirun"
SHIM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpi_rank.py")
POLL = 0.02             # seconds between looks at a rank's pid and exit files
LOST_GRACE = 1.0        # seconds a rank's process may be gone before its exit file
# What a remote rank needs from node 0's environment (mpirun gives remote ranks only
# the variables named with -x); per-node values (DG_NODE_RANK, DG_CONTROL_DIR) are set
# by the shim.
_FORWARD = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV")
# COVERAGE_: coverage.py's process start-up (COVERAGE_PROCESS_START), so that a
# measured job is measured on every host and under mpirun too
_FORWARD_PREFIXES = ("DG_", "MXNET_", "HOROVOD_", "PYTHON", "OMP_", "KMP_", "COVERAGE_")
# Left by an enclosing horovodrun or Gloo job; they would override MPI in the ranks.
_STALE = re.compile(r"^HOROVOD_(GLOO_|RANK$|SIZE$|LOCAL_|CROSS_|HOSTNAME$)")


def mpirun_path() -> str | None:
    """OpenMPI's mpirun, or None when it is not on PATH."""
    return shutil.which(MPIRUN)


def _link_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def control_link(spec: RoundSpec, node_rank: int | None = None) -> str:
    """Where node ``node_rank`` links its job-control directory for the ranks of this
    run, the same path on every node (None: the template with ``{node}``)."""
    job = re.sub(r"[^\w.-]", "_", f"{spec.master_addr}-{spec.rendezvous_port}")
    name = f"dg-mpi-{job}-r{spec.restart}-node" + (
        "{node}" if node_rank is None else str(node_rank))
    return os.path.join(_link_dir(), name)


def _read_ints(path: str) -> list[float] | None:
    try:
        with open(path) as f:
            return [float(x) for x in f.read().split()]
    except (OSError, ValueError):
        return None


def _group_alive(pgid: int | None) -> bool:
    if pgid is None:
        return False
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


class Rank:
    """One MPI rank of this node, with the face of a launcher child process
    (:class:`~dist_gluon.launch.processes.Process`): label, role, rank, returncode,
    ended_at, tail, signal_group, group_alive, flush_output and ``popen.wait``.

    Its status comes from the files its shim writes; its output from the named pipes it
    writes to. ``mpirun`` is the job's mpirun process on node 0 (None elsewhere): when
    it ends before this rank ever started, the rank ends with mpirun's status and
    output, which says why (a host it could not reach, a bad option)."""

    role = "worker"

    def __init__(self, rank: int, directory: str, mpirun: Process | None = None,
                 owned_link: str | None = None):
        self.label, self.rank = str(rank), rank
        self.mpirun = mpirun
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.ended_at: float | None = None
        self.pid: int | None = None            # the rank's process (and process group)
        self.popen = self                      # processes.terminate() waits on p.popen
        self._returncode: int | None = None
        self._link = owned_link
        self._stopped = False
        self._paths = {kind: os.path.join(directory, f"rank{rank}.{kind}")
                       for kind in ("out", "err", "pid", "exit")}
        for kind in ("out", "err"):
            os.mkfifo(self._paths[kind], 0o600)
        self._relays = [threading.Thread(target=self._relay, args=(kind,), daemon=True)
                        for kind in ("out", "err")]
        for t in self._relays:
            t.start()
        threading.Thread(target=self._watch, daemon=True).start()

    # ------------------------------------------------------------------ status
    @property
    def returncode(self) -> int | None:
        return self._returncode if self.ended_at is not None else None

    def _end(self, code: int, when: float) -> None:
        self._returncode = code
        self.ended_at = when

    def _watch(self) -> None:
        gone_since = None
        while not self._stopped:
            if self.pid is None:
                found = _read_ints(self._paths["pid"])
                self.pid = int(found[0]) if found else None
            ended = _read_ints(self._paths["exit"])
            if ended and len(ended) == 3:
                self._end(int(ended[1]), ended[2])
                return
            if self.pid is not None and not _group_alive(self.pid):
                # the shim was killed before it could write the exit status (SIGKILL);
                # its rank died with it
                gone_since = gone_since or time.monotonic()
                if time.monotonic() - gone_since > LOST_GRACE:
                    self._end(-signal.SIGKILL, time.time())
                    return
            elif self.pid is None and self.mpirun is not None \
                    and self.mpirun.returncode is not None:
                self.mpirun.flush_output()
                self.tail.extend(f"mpirun: {line}" for line in self.mpirun.tail)
                self._end(self.mpirun.returncode or 1, time.time())
                return
            time.sleep(POLL)

    # ------------------------------------------------------------------ output
    def _relay(self, kind: str) -> None:
        try:
            # blocks until the shim opens the pipe (or flush_output gives up on it)
            fd = os.open(self._paths[kind], os.O_RDONLY)
        except OSError:
            return
        to_stderr = kind == "err"
        with os.fdopen(fd, "rb") as pipe:
            for raw in iter(pipe.readline, b""):
                line = raw.decode("utf-8", "replace").rstrip("\n")
                if to_stderr:
                    self.tail.append(line)
                output.emit(f"[{self.label}] {line}\n", to_stderr)

    def flush_output(self, timeout: float = 2.0) -> None:
        for kind, t in zip(("out", "err"), self._relays):
            if t.is_alive():
                try:        # a reader still waiting for a writer: open and close one
                    os.close(os.open(self._paths[kind], os.O_WRONLY | os.O_NONBLOCK))
                except OSError:
                    pass
            t.join(timeout)
        if self.mpirun is not None:
            self.mpirun.flush_output(timeout)
        self._stopped = True
        if self._link:
            try:
                os.unlink(self._link)
            except OSError:
                pass

    # ------------------------------------------------------------------ control
    def signal_group(self, sig) -> None:
        if self.pid is not None:
            try:
                os.killpg(self.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        if self.mpirun is not None:
            self.mpirun.signal_group(sig)

    def group_alive(self) -> bool:
        return _group_alive(self.pid) or (self.mpirun is not None
                                          and self.mpirun.group_alive())

    def wait(self, timeout: float | None = None) -> int | None:
        """``popen.wait`` of a child: until the rank has ended (or never started) and,
        on node 0, mpirun too."""
        limit = None if timeout is None else time.monotonic() + timeout
        while (self.ended_at is None and self.pid is not None and not self._stopped) \
                or (self.mpirun is not None and self.mpirun.returncode is None):
            if limit is not None and time.monotonic() > limit:
                raise subprocess.TimeoutExpired(f"rank {self.rank}", timeout)
            time.sleep(POLL)
        return self.returncode


# ---------------------------------------------------------------------- mpirun
def _root_options(environ) -> tuple[list[str], dict[str, str]]:
    if os.geteuid() != 0:
        return [], {}
    return ["--allow-run-as-root"], {"OMPI_ALLOW_RUN_AS_ROOT": "1",
                                     "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def cpu_workers(environ: dict[str, str], devices: str = "/dev") -> bool:
    """Whether this job's workers compute on CPUs: no NVIDIA device on this host, or
    ``CUDA_VISIBLE_DEVICES`` hides them all (the hosts of a job are alike)."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1", "none", "NoDevFiles"):
        return True
    return not any(re.fullmatch(r"nvidia\d+", name) for name in _listdir(devices))


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def cpu_defaults(environ: dict[str, str]) -> list[str]:
    """mpirun's options for CPU workers that the user did not set: OpenMPI's waiting
    rank then yields its core instead of polling without pause (``mpi_yield_when_idle``).
    horovod's background thread waits in MPI every cycle, and the poll took a whole core
    of 2 (3.9 s of CPU in 4 s idle, benchmarks/FINDINGS.md 9c) from the computation
    that shares the cores with it; a GPU job keeps OpenMPI's default, since a yield
    adds latency to every wait and the GPU, not the cores, computes there."""
    if "OMPI_MCA_mpi_yield_when_idle" in environ or not cpu_workers(environ):
        return []
    return ["--mca", "mpi_yield_when_idle", "1"]


def _network_cidr(addr: str) -> str | None:
    """The IPv4 network (CIDR) of this host's interface that carries ``addr``."""
    try:
        out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True,
                             text=True, timeout=5, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for match in re.finditer(r"\binet ([\d.]+/\d+)", out):
        iface = ipaddress.ip_interface(match.group(1))
        if str(iface.ip) == addr:
            return str(iface.network)
    return None


def mpirun_command(spec: RoundSpec, config: LaunchConfig, environ: dict[str, str],
                   hosts: list[str] | None = None) -> tuple[list[str], dict[str, str]]:
    """mpirun's argv and environment for one run of the job.

    Parameters
    ----------
    spec : RoundSpec
        The run's spec (node 0's decisions): nproc, nnodes, restart, master_addr,
        rendezvous_port.
    config : LaunchConfig
        The launcher's settings: command, ssh_port, ssh_identity_file, iface.
    environ : dict
        The workers' common environment (DG_* and the rest), from the node.
    hosts : list of str, optional
        Every node's host, in node-rank order, when there are several nodes.
    """
    nproc, nnodes = spec.nproc, spec.nnodes
    root_flags, root_env = _root_options(environ)
    env = {k: v for k, v in environ.items() if not _STALE.match(k)}
    env.update(root_env)
    env.update({"HOROVOD_CONTROLLER": "mpi", "HOROVOD_CPU_OPERATIONS": "mpi",
                "DG_MPI_CONTROL": control_link(spec)})
    # fork() after MPI_Init is safe over shared memory and TCP (the transports used here),
    # and Gluon's DataLoader(num_workers > 0) forks: no warning for it
    env.setdefault("OMPI_MCA_mpi_warn_on_fork", "0")
    argv = [MPIRUN, *root_flags, "-np", str(nproc * nnodes), "--bind-to", "none",
            # the launcher, not mpirun, ends the job when a rank fails (and names it)
            "--mca", "orte_abort_on_non_zero_status", "0", *cpu_defaults(env)]
    if nnodes == 1:
        argv += ["--host", f"localhost:{nproc}", "--mca", "btl", "self,vader"]
    else:
        master = spec.master_addr
        argv += ["--host", ",".join(f"{h}:{nproc}" for h in hosts), "--map-by", "slot",
                 "--mca", "btl", "self,vader,tcp",
                 # node 0 starts every node's daemon itself (nodes need not reach each
                 # other over ssh), with the ssh options of -H
                 "--mca", "plm_rsh_no_tree_spawn", "1",
                 "--mca", "plm_rsh_args", " ".join(ssh.ssh_argv(config, "")[1:-1])]
        network = config.iface or _network_cidr(master)
        if network:
            argv += ["--mca", "oob_tcp_if_include", network,
                     "--mca", "btl_tcp_if_include", network]
        for name in sorted(env):
            if name in _FORWARD or name.startswith(_FORWARD_PREFIXES) \
                    or name in root_env:
                argv += ["-x", name]
    argv += [sys.executable, SHIM, *config.command]
    return argv, env


def start(node, base: dict[str, str]) -> None:
    """Start this node's part of a ``--transport mpi`` run: make its ranks' job-control
    files and add a :class:`Rank` for each to ``node.processes``; on node 0 also start
    mpirun for the whole job."""
    spec = node.spec
    directory = base[jobcontrol.ENV_DIR]
    link = control_link(spec, node.node_rank)
    if os.path.lexists(link):
        os.unlink(link)
    os.symlink(directory, link)
    ranks = []
    for local_rank in range(spec.nproc):
        rank, _ = node._worker_env(base, local_rank)
        ranks.append(Rank(rank, directory, owned_link=link if local_rank == 0 else None))
    node.processes.extend(ranks)
    if node.node_rank != 0:
        return
    hosts = None
    if spec.nnodes > 1:
        hosts = [spec.master_addr] + list(spec.hosts[1:])
    argv, env = mpirun_command(spec, node.config, base, hosts)
    try:
        mpirun = Process("mpirun", "mpirun", None, argv, env)
    except OSError as err:
        raise SystemExit(f"dist_gluon.launch: cannot start {MPIRUN!r} for --transport "
                         f"mpi: {err}") from err
    for r in ranks:
        r.mpirun = mpirun
