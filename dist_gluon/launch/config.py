"""What the launcher was asked to do: one frozen :class:`LaunchConfig`, made once from the
command line (cli.py) and read by everything below it (the master, the agents, a node's
processes, the ssh fan-out). Nothing below cli.py sees argparse."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

BACKENDS = ("horovod", "dist_sync", "p3", "dist_async")
TRANSPORTS = ("gloo", "mpi")


class Host(NamedTuple):
    """A host of -H/--hostfile: its workers (slots; 0 for a host that only runs ps-lite
    servers) and its ps-lite servers (None: the launcher's --servers)."""

    name: str
    slots: int
    servers: int | None = None


@dataclass(frozen=True)
class LaunchConfig:
    """One launcher's settings, checked and with every default resolved.

    Parameters
    ----------
    command : tuple of str
        The worker command (what followed ``--``).
    backend, transport : str
        One of BACKENDS; ``gloo`` or ``mpi`` (horovod only).
    num_workers : int
        Workers on this node (-n); 0 on a node that only runs ps-lite servers.
    servers : int
        ps-lite servers on this node (0 on worker-only nodes, or with horovod).
    nnodes : int or None
        Nodes of the job (MAX of an elastic job); None only for -H without --nnodes.
    elastic : bool
        ``--nnodes MIN:MAX``: the job re-forms between ``min_nodes`` and ``max_nodes``.
        Also a job on this machine alone with ``--max-restarts`` (``one_machine``).
    warm_standby : bool
        A job that may restart keeps one warm standby process per worker, which a
        restarted worker's script runs in (standby.py); ``--no-warm-standby``: not.
    tune : bool
        horovod over Gloo: the workers tune horovod's cycle time on the job's first
        steps (dist_gluon/backends/horovod_tuning.py); ``--no-tune`` (or
        ``DG_TUNE=0``): horovod's default, or the user's variables.
    one_machine : bool
        Elastic because a job on one machine (no ``--nnodes``, ``-H`` or
        ``--hostfile``) may restart: as ``--nnodes 1:1``, so that workers under
        ``dist_gluon.elastic.run`` recover in memory, but SIGTERM ends it at once
        (no preemption, which a job of one node cannot outlive).
    node_rank : int or None
        This node's rank; None when this launcher fans out over ssh (-H/--hostfile).
    stall_warning : float or None
        Seconds before a stall is reported; None: never (``--stall-warning 0``).
    job_secret : str or None
        The secret every launcher of the job shares (secret.py); None with -H, whose
        launcher makes one per job.
    host_slots : tuple of Host or None
        -H/--hostfile: the hosts to start one launcher on each; None otherwise.
    half_open_limit : int
        Connections a listening launcher serves at once before they said hello (more
        wait in the kernel's queue); from DG_HALF_OPEN_LIMIT, default 32 (channel.py).
    """

    command: tuple[str, ...]
    # the job, on every node
    backend: str = "horovod"
    transport: str = "gloo"
    num_workers: int = 1
    servers: int = 1
    compat: str | None = None
    timeout: float | None = None
    max_restarts: int = 0
    warm_standby: bool = True
    tune: bool = True
    # watching the workers
    stall_warning: float | None = 60.0
    stall_timeout: float | None = None
    stacks_signal: str | None = None
    # seeing where the time goes (observe.py)
    timeline: str | None = None
    report: str = "text"
    report_every: float | None = None
    # several machines, one launcher per node
    nnodes: int | None = 1
    elastic: bool = False
    one_machine: bool = False
    min_nodes: int | None = 1
    max_nodes: int | None = 1
    node_rank: int | None = 0
    master_addr: str | None = None
    master_port: int = 29500
    join_timeout: float = 300.0
    heartbeat: float = 0.5
    silence_limit: float = 8.0
    preempt_grace: float = 20.0
    last_call: float = 10.0
    server_nodes: int | None = None
    iface: str | None = None
    half_open_limit: int = 32      # channel.HALF_OPEN_LIMIT
    job_secret: str | None = field(default=None, repr=False)
    job_secret_file: str | None = None
    # several machines, one command over ssh
    host_slots: tuple[Host, ...] | None = None
    ssh_port: int | None = None
    ssh_identity_file: str | None = None

    @property
    def over_ssh(self) -> bool:
        """This launcher starts one launcher per host over ssh (-H/--hostfile)."""
        return self.host_slots is not None

    @property
    def several_nodes(self) -> bool:
        """The job may span more than one node (the channel and a real address)."""
        return (self.max_nodes or 1) > 1
