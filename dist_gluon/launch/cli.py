"""The launcher's command line: argument groups as torchrun's ``torch.distributed.run``,
checked once and turned into one frozen :class:`~dist_gluon.launch.config.LaunchConfig`
(:func:`parse`). A usage error exits 2 with argparse's ``usage:`` line; nothing after
:func:`parse` sees the argparse namespace."""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from .. import jobcontrol
from .._version import __version__
from . import mpi, secret, slurm, ssh
from .channel import HALF_OPEN_LIMIT, HEARTBEAT, SILENCE, STATUS_EVERY
from .config import BACKENDS, TRANSPORTS, LaunchConfig

DEFAULT_MASTER_PORT = 29500
PREEMPT_GRACE = 20.0    # default of --preempt-grace
LAST_CALL = 10.0        # default of --last-call
HALF_OPEN_ENV = "DG_HALF_OPEN_LIMIT"

_AT_LEAST_ONE_WORKER = ("-n must be at least 1 (0 only on a node of a ps-lite job of several "
                        "nodes that runs servers alone), got {}")
_AT_LEAST_ONE_SERVER = ("--servers must be at least 1 (0 only on worker nodes of a job of "
                        "several nodes whose other nodes serve), got {}")


def parse(argv: list[str]) -> LaunchConfig:
    """The launcher's configuration from its arguments (without the program name);
    exits 2 with a usage message when they do not make a job."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    _check(parser, ns)
    fields = {f.name for f in dataclasses.fields(LaunchConfig)}
    values = {k: v for k, v in vars(ns).items() if k in fields}
    values["command"] = tuple(ns.command)
    values["half_open_limit"] = _half_open_limit(parser)
    if values.get("host_slots") is not None:
        values["host_slots"] = tuple(values["host_slots"])
    return LaunchConfig(**values)


def _half_open_limit(parser) -> int:
    """DG_HALF_OPEN_LIMIT: connections served at once before their hello (channel.py)."""
    text = os.environ.get(HALF_OPEN_ENV)
    if text is None:
        return HALF_OPEN_LIMIT
    try:
        limit = int(text)
    except ValueError:
        limit = 0
    if limit < 1:
        parser.error(f"{HALF_OPEN_ENV} must be a positive integer, got {text!r}")
    return limit


def build_parser() -> argparse.ArgumentParser:
    script = os.path.basename(sys.argv[0]) if sys.argv else ""
    parser = argparse.ArgumentParser(
        prog=script if script.startswith("dist-gluon-run") else "python -m dist_gluon.launch",
        description="Run COMMAND as data-parallel workers of a dist_gluon job, on this "
                    "machine or on several.",
        epilog="examples:\n"
               "  python -m dist_gluon.launch -n 2 --backend dist_sync -- python train.py\n"
               "  dist-gluon-run --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 -n 2 -- "
               "python train.py\n"
               "  dist-gluon-run -H host1:2,host2:2 --backend p3 -- python train.py",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"dist_gluon {__version__}")
    _job_arguments(parser)
    _watch_arguments(parser)
    _node_arguments(parser.add_argument_group("several machines: one launcher per node"))
    fan = parser.add_argument_group("several machines: one command over ssh")
    fan.add_argument("-H", "--hosts", default=None,
                     help="host1:N1,host2:N2,... start a launcher on each host over ssh")
    fan.add_argument("--hostfile", default=None,
                     help="file of lines 'host slots=N' (same as -H)")
    fan.add_argument("--ssh-port", type=int, default=None, help="ssh port of every host")
    fan.add_argument("--ssh-identity-file", default=None, help="ssh private key")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the worker command, after --")
    return parser


def _job_arguments(parser) -> None:
    parser.add_argument("-n", "--num-workers", "--nproc-per-node", type=int, default=None,
                        help="worker processes per node (>= 1; 0 on a node of a ps-lite "
                             "job that only runs servers); with -H/--hostfile, "
                             "the slots of each host")
    parser.add_argument("--backend", default="horovod", choices=BACKENDS,
                        help="communication backend (default: horovod)")
    parser.add_argument("--transport", default="gloo", choices=TRANSPORTS,
                        help="horovod: collectives over Gloo, or over MPI with the ranks "
                             "started by OpenMPI's mpirun, faster on dedicated cores "
                             "(default: gloo)")
    parser.add_argument("--servers", type=int, default=1,
                        help="ps-lite servers per node for dist_sync, p3 and dist_async "
                             "(default: 1; 0 on worker nodes when other nodes serve)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds the whole job may run; then everything is "
                             "terminated and the launcher exits 124")
    parser.add_argument("--no-warm-standby", dest="warm_standby", action="store_false",
                        default=os.environ.get("DG_WARM_STANDBY", "1") != "0",
                        help="do not keep a warm standby process per worker (MXNet and "
                             "dist_gluon imported) for a restarted worker's script to run "
                             "in: restarted workers start a new interpreter (also "
                             "DG_WARM_STANDBY=0)")
    parser.add_argument("--no-tune", dest="tune", action="store_false",
                        default=os.environ.get("DG_TUNE", "1") != "0",
                        help="horovod over Gloo: do not tune horovod's cycle time on the "
                             "job's first steps (the choice is kept for the rest of the "
                             "run; HOROVOD_CYCLE_TIME or HOROVOD_FUSION_THRESHOLD set by "
                             "the user win either way): horovod's defaults (also "
                             "DG_TUNE=0)")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="restart the whole job (every node) up to R times after a "
                             "failure, or (--nnodes MIN:MAX) after a failure or a lost "
                             "node; scripts resume from their last checkpoint, or, under "
                             "dist_gluon.elastic.run, from their last commit in memory "
                             "(on one machine as with --nnodes MIN:MAX)")


def _watch_arguments(parser) -> None:
    parser.add_argument("--stall-warning", type=float, default=60.0, metavar="SEC",
                        help="report ranks that have not reached a collective the others "
                             "have waited in for SEC seconds, with their Python stacks "
                             "(default: 60; 0 turns it off)")
    parser.add_argument("--stacks-signal", default=None, metavar="NAME",
                        help="the signal that asks a worker for its Python stacks in a "
                             "stall report (default: DG_STACKS_SIGNAL, else "
                             f"{jobcontrol.DEFAULT_STACKS_SIGNAL}; SIGUSR1 and SIGUSR2 are "
                             "left to schedulers and scripts)")
    parser.add_argument("--stall-timeout", type=float, default=None, metavar="SEC",
                        help="end the job when such a stall lasts SEC seconds "
                             "(default: never)")
    parser.add_argument("--compat", default=None, choices=("byteps",),
                        help="byteps: run scripts written for byteps.mxnet unchanged, on any "
                             "--backend; their `import byteps.mxnet` finds "
                             "dist_gluon.compat.byteps (BytePS itself is not needed)")
    seeing = parser.add_argument_group("seeing where the time goes (docs/observability.md)")
    seeing.add_argument("--timeline", default=os.environ.get("DG_TIMELINE") or None,
                        metavar="FILE",
                        help="write one Chrome trace JSON of the whole job to FILE: a "
                             "track per rank (steps, data, waits, collectives, codecs, "
                             "the update) and the launcher's events (default: "
                             "DG_TIMELINE; opens in ui.perfetto.dev or chrome://tracing)")
    seeing.add_argument("--report", default="text", choices=("text", "json", "off"),
                        help="the per-rank report (step times, where they go, the "
                             "straggler, the bound) at the end of the job: a table on "
                             "stderr (text, the default), one JSON line on stdout "
                             "(json), or none (off)")
    seeing.add_argument("--report-every", type=float, default=None, metavar="SEC",
                        help="also print the report every SEC seconds while the job runs")


def _node_arguments(nodes) -> None:
    nodes.add_argument("--nnodes", default=None, metavar="N|MIN:MAX",
                       help="number of nodes (default: 1, or SLURM's node count under srun);"
                            " MIN:MAX makes the job elastic: it starts with MIN to MAX "
                            "nodes, goes on without a node that fails, is cut off or is "
                            "preempted while MIN remain, and admits nodes that join later "
                            "up to MAX, re-forming from the last checkpoint")
    nodes.add_argument("--preempt-grace", type=float, default=PREEMPT_GRACE, metavar="SEC",
                       help="elastic: on SIGTERM (a preemption notice) this node's "
                            "launcher asks every worker for a checkpoint at its next step "
                            "boundary and leaves within SEC seconds (default: "
                            f"{PREEMPT_GRACE:g})")
    nodes.add_argument("--last-call", type=float, default=LAST_CALL, metavar="SEC",
                       help="elastic, node 0: once MIN nodes have joined, start when no "
                            f"other joins for SEC seconds (default: {LAST_CALL:g}), or "
                            "at once when MAX have")
    nodes.add_argument("--node-rank", type=int, default=None,
                       help="this node's rank in [0, nnodes) (default: 0, or SLURM_NODEID)")
    nodes.add_argument("--master-addr", default=None,
                       help="address of node 0, reachable from every node (default under "
                            "srun: the first host of the job's node list); elastic: of "
                            "any node of the job for a node that joins later")
    nodes.add_argument("--master-port", type=int, default=DEFAULT_MASTER_PORT,
                       help=f"port of node 0's launcher (default: {DEFAULT_MASTER_PORT})")
    nodes.add_argument("--join-timeout", type=float, default=300.0, metavar="SEC",
                       help="seconds for every node to join (default: 300); a node "
                            "whose join fails for a reason that can pass (node 0 not "
                            "listening yet, or too busy) tries again until then")
    nodes.add_argument("--heartbeat", type=float, default=HEARTBEAT, metavar="SEC",
                       help="node 0's launcher tells the others it is alive at least every "
                            f"SEC seconds (default: {HEARTBEAT:g}; the others report "
                            f"their ranks within {STATUS_EVERY:g} s of a change, and "
                            "every SEC seconds)")
    nodes.add_argument("--silence-limit", type=float, default=SILENCE, metavar="SEC",
                       help="a launcher that hears nothing from another for SEC seconds, "
                            "or cannot send to it for as long, ends the job naming it "
                            f"(default: {SILENCE:g}; give every node the same value)")
    nodes.add_argument("--server-nodes", type=int, default=None, metavar="K",
                       help="ps-lite: the last K nodes only run servers (--servers each) "
                            "and the others only workers; one command for every node, "
                            "e.g. under srun")
    nodes.add_argument("--iface", default=None,
                       help="horovod: network interface for Gloo (default: the one that "
                            "carries this node's route to the master)")
    nodes.add_argument(secret.FILE_FLAG, default=None, metavar="PATH",
                       help="file holding the job secret, the same on every node, that "
                            "lets only the job's own launchers join (default: "
                            f"${secret.ENV}; a job of several nodes needs one)")


# ---------------------------------------------------------------------- checks
# Each check completes the namespace (resolved defaults, SLURM's values, the job secret)
# or stops with a usage error; their order decides which complaint a user sees first.
def _check(parser, ns) -> None:
    if ns.command and ns.command[0] == "--":
        ns.command = ns.command[1:]
    if not ns.command:
        parser.error("no command given: put the worker command after --, e.g. "
                     "-- python train.py")
    if ns.hosts and ns.hostfile:
        parser.error("give either -H/--hosts or --hostfile, not both")
    ns.host_slots = ns.job_secret = None
    _check_elastic(parser, ns)
    if ns.hosts or ns.hostfile:
        _check_hosts(parser, ns)
    if ns.num_workers is None:
        parser.error("-n is required: the number of workers per node")
    if ns.num_workers < 0:
        parser.error(_AT_LEAST_ONE_WORKER.format(ns.num_workers))
    if ns.servers < 0:
        parser.error(_AT_LEAST_ONE_SERVER.format(ns.servers))
    if ns.transport == "mpi" and ns.backend != "horovod":
        parser.error(f"--transport mpi is for --backend horovod, not {ns.backend}")
    if ns.transport == "mpi" and not mpi.mpirun_path():
        parser.error("--transport mpi needs OpenMPI's mpirun on PATH (Debian: apt-get "
                     "install openmpi-bin libopenmpi-dev, then `make setup` rebuilds "
                     "horovod with MPI); or use --transport gloo")
    if ns.max_restarts < 0:
        parser.error(f"--max-restarts must be >= 0, got {ns.max_restarts}")
    if ns.stacks_signal is not None:
        try:
            jobcontrol.stacks_signal({"DG_STACKS_SIGNAL": ns.stacks_signal})
        except ValueError as err:
            parser.error(f"--stacks-signal: {err}")
    _check_times(parser, ns)
    if ns.timeline and not os.path.isdir(os.path.dirname(os.path.abspath(ns.timeline))):
        parser.error(f"--timeline {ns.timeline}: its directory does not exist")
    if not 0 < ns.master_port < 65536:
        parser.error(f"--master-port must be in [1, 65535], got {ns.master_port}")
    if ns.host_slots is None:
        _check_nodes(parser, ns)
    _check_servers(parser, ns)


def _check_times(parser, ns) -> None:
    if not 0 < ns.heartbeat < ns.silence_limit:
        parser.error(f"--heartbeat ({ns.heartbeat:g}) must be positive and shorter than "
                     f"--silence-limit ({ns.silence_limit:g})")
    for name in ("timeout", "stall_timeout", "join_timeout", "preempt_grace",
                 "report_every"):
        value = getattr(ns, name)
        if value is not None and value <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {value:g}")
    if ns.stall_warning is not None and ns.stall_warning < 0:
        parser.error(f"--stall-warning must be >= 0, got {ns.stall_warning:g}")
    if ns.stall_warning == 0:
        ns.stall_warning = None


def _check_hosts(parser, ns) -> None:
    """-H/--hostfile: the hosts, and -n from their slots when not given."""
    try:
        ns.host_slots = ssh.parse_hosts(ns.hosts) if ns.hosts \
            else ssh.read_hostfile(ns.hostfile)
    except ValueError as err:
        parser.error(str(err))
    if (ns.nnodes is not None and not ns.elastic) or ns.node_rank is not None:
        parser.error("-H/--hostfile starts one launcher per host itself; do not add "
                     "--nnodes or --node-rank (except --nnodes MIN:MAX, which makes "
                     "the job elastic)")
    if ns.elastic and len(ns.host_slots) > ns.max_nodes:
        parser.error(f"-H/--hostfile names {len(ns.host_slots)} hosts, more than "
                     f"the MAX {ns.max_nodes} of --nnodes")
    if ns.num_workers is None:
        ns.num_workers = max(host.slots for host in ns.host_slots)


def _check_elastic(parser, ns) -> None:
    """--nnodes N or MIN:MAX: ``elastic``, ``min_nodes``, ``max_nodes``, and ``nnodes``
    as an int (MAX for an elastic job), or None when not given."""
    text = ns.nnodes
    ns.elastic = text is not None and ":" in text
    ns.min_nodes = ns.max_nodes = None
    ns.one_machine = (text is None and ns.max_restarts > 0 and not ns.hosts
                      and not ns.hostfile and ns.node_rank is None
                      and ns.transport != "mpi" and not _under_slurm_nodes())
    if ns.one_machine:
        # one machine that may restart: as --nnodes 1:1, so that a script under
        # dist_gluon.elastic.run recovers from its last commit in memory rather than
        # from its start (--transport mpi cannot: mpirun starts a fixed set of ranks)
        text = "1:1"
        ns.elastic = True
    if text is None:
        return
    low, _, high = text.partition(":")
    try:
        ns.min_nodes = int(low)
        ns.max_nodes = int(high) if ns.elastic else ns.min_nodes
    except ValueError:
        parser.error(f"--nnodes must be a number of nodes N or a range MIN:MAX (e.g. "
                     f"2:4), got {text!r}")
    if ns.elastic and not 1 <= ns.min_nodes <= ns.max_nodes:
        parser.error(f"--nnodes MIN:MAX needs 1 <= MIN <= MAX, got {text!r}")
    ns.nnodes = ns.max_nodes
    if not ns.elastic:
        return
    if ns.transport == "mpi":
        parser.error("--nnodes MIN:MAX needs --transport gloo: mpirun starts a fixed set "
                     "of ranks, which cannot change while the job runs")
    if ns.last_call < 0:
        parser.error(f"--last-call must be >= 0, got {ns.last_call:g}")


def _under_slurm_nodes() -> bool:
    """srun started this launcher as one of several nodes (SLURM counts them)."""
    try:
        defaults = slurm.defaults(os.environ)
    except ValueError:
        return True         # _check_nodes says why
    return bool(defaults) and defaults["nnodes"] > 1


def _check_servers(parser, ns) -> None:
    """Nodes that only serve or only work (ps-lite): -n 0 or --servers 0 on one node,
    hosts with 0 slots in -H/--hostfile, or --server-nodes K for the last K nodes."""
    pslite = ns.backend != "horovod"
    if ns.host_slots is not None:
        if ns.server_nodes is not None:
            parser.error("--server-nodes is for one launcher per node; with -H/--hostfile "
                         "give each server-only host 0 slots and its servers: host:0:S, "
                         "or 'host slots=0 servers=S'")
        if not pslite and any(host.slots == 0 for host in ns.host_slots):
            parser.error("a host with 0 slots only runs ps-lite servers, and --backend "
                         "horovod has none: use --backend dist_sync, p3 or dist_async")
        servers = sum(ns.servers if host.servers is None else host.servers
                      for host in ns.host_slots)
        if pslite and servers < 1:
            parser.error("the hosts run no ps-lite server: give some host servers "
                         "(host:N:S, 'servers=S' in a hostfile, or --servers)")
        return
    if ns.elastic and ns.node_rank == 0 and ns.num_workers == 0:
        parser.error("node 0 of an elastic job must run workers: rank 0, which writes the "
                     "checkpoints, lives on node 0, the one node the job cannot lose")
    if ns.server_nodes is not None:
        _check_server_nodes(parser, ns, pslite)
    if ns.nnodes == 1 and ns.num_workers == 0:
        parser.error(_AT_LEAST_ONE_WORKER.format(0))
    if ns.num_workers == 0 and not pslite:
        parser.error("-n 0 makes a node that only runs ps-lite servers, and --backend "
                     "horovod has none: use --backend dist_sync, p3 or dist_async")
    if ns.nnodes == 1 and ns.servers == 0 and pslite:
        parser.error(_AT_LEAST_ONE_SERVER.format(0))
    if ns.num_workers == 0 and ns.servers == 0:
        parser.error("-n 0 with --servers 0: this node would run neither workers nor "
                     "servers")


def _check_server_nodes(parser, ns, pslite: bool) -> None:
    """--server-nodes K: this node's role (servers only, or workers only) from its rank."""
    if ns.elastic:
        parser.error("--server-nodes counts nodes from the end of a fixed set; in an "
                     "elastic job give the server-only nodes -n 0 --servers S instead")
    if not pslite:
        parser.error("--server-nodes needs a ps-lite backend (dist_sync, p3 or "
                     "dist_async); horovod has no servers")
    if not 0 < ns.server_nodes < ns.nnodes:
        parser.error(f"--server-nodes must be in [1, {ns.nnodes - 1}] (some nodes "
                     f"must run workers), got {ns.server_nodes}")
    if ns.servers < 1:
        parser.error(_AT_LEAST_ONE_SERVER.format(ns.servers))
    if ns.node_rank >= ns.nnodes - ns.server_nodes:
        ns.num_workers = 0
    else:
        ns.servers = 0


def _check_nodes(parser, ns) -> None:
    """--nnodes/--node-rank/--master-addr, with SLURM's values as defaults under srun;
    then the job secret."""
    try:
        defaults = slurm.defaults(os.environ)
    except ValueError as err:
        if ns.nnodes is None:
            parser.error(str(err))
        defaults = None     # --nnodes given: the launcher does not rely on SLURM's count
    if defaults:
        # under srun SLURM names this node and node 0, and counts the nodes unless
        # --nnodes (e.g. MIN:MAX) is given
        if ns.nnodes is None:
            ns.nnodes = defaults["nnodes"]
        if ns.node_rank is None:
            ns.node_rank = defaults["node_rank"]
        if ns.master_addr is None:
            ns.master_addr = defaults["master_addr"]
    if ns.nnodes is None:
        ns.nnodes = 1
    if not ns.elastic:
        ns.min_nodes = ns.max_nodes = ns.nnodes
    ns.node_rank = 0 if ns.node_rank is None else ns.node_rank
    if ns.nnodes < 1:
        parser.error(f"--nnodes must be at least 1, got {ns.nnodes}")
    if not 0 <= ns.node_rank < ns.nnodes:
        parser.error(f"--node-rank must be in [0, {ns.nnodes}), got {ns.node_rank}"
                     + (" (node ranks of an elastic job range up to its MAX nodes; a node "
                        "that joins late takes a rank no node of the job has now)"
                        if ns.elastic else ""))
    if ns.nnodes > 1 and not ns.master_addr:
        parser.error("--nnodes > 1 needs --master-addr: the address of node 0, reachable "
                     "from every node")
    try:
        ns.job_secret = (secret.read_from_stdin() if os.environ.get(ssh.PARENT_ENV) == "ssh"
                         else secret.for_node(ns.job_secret_file, os.environ, ns.nnodes))
    except ValueError as err:
        parser.error(str(err))
