"""One launcher for every backend, on one machine or many.

    python -m dist_gluon.launch -n 2 --backend horovod -- python train.py --epochs 3
    dist-gluon-run -n 4 --backend dist_sync --servers 2 -- python train.py
    # one launcher per machine (as torchrun), the same command on every machine:
    dist-gluon-run --nnodes 2 --node-rank I --master-addr 10.0.0.1 -n 4 -- python train.py
    # or one command that starts them over ssh:
    dist-gluon-run -H host1:4,host2:4 --backend p3 -- python train.py

``-n`` is the number of workers per node; global rank = node rank * N + local rank.
On ps-lite a node may run servers only (``-n 0 --servers S``, ``host:0:S`` with -H,
``--server-nodes K`` for the last K nodes) or workers only (``--servers 0``); ranks are
then numbered over the nodes that run workers.
Every line a process prints is prefixed with its rank (``[0]``, ``[server1]``,
``[scheduler]``). Workers report their progress and how they ended over a job-control
channel (dist_gluon/jobcontrol.py), and the launchers of one job report to node 0's: the
job fails as a whole as soon as a worker fails, or leaves while others wait in a
collective it will never join; the report names the rank that left first, its host, how
it ended and why, and lists later errors as consequences. ``--stall-warning`` reports
ranks that lag behind a collective the others wait in, with their Python stacks;
``--stall-timeout`` ends such a job. ``--max-restarts`` restarts all nodes in lockstep;
``--timeout`` bounds the whole job.

The launcher is a process supervisor: it imports neither mxnet nor horovod.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from .. import jobcontrol
from .._version import __version__
from . import mpi, output, secret, slurm, ssh
from .channel import HEARTBEAT, SILENCE
from .job import STATUS_EVERY, Agent, Interrupted, Master, Preemption
from .node import COMPAT_ENV

BACKENDS = ("horovod", "dist_sync", "p3", "dist_async")
DEFAULT_MASTER_PORT = 29500
PREEMPT_GRACE = 20.0    # default of --preempt-grace
LAST_CALL = 10.0        # default of --last-call


def _parse_args(argv):
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
    parser.add_argument("-n", "--num-workers", "--nproc-per-node", type=int, default=None,
                        help="worker processes per node (>= 1; 0 on a node of a ps-lite "
                             "job that only runs servers); with -H/--hostfile, "
                             "the slots of each host")
    parser.add_argument("--backend", default="horovod", choices=BACKENDS,
                        help="communication backend (default: horovod)")
    parser.add_argument("--transport", default="gloo", choices=("gloo", "mpi"),
                        help="horovod: collectives over Gloo, or over MPI with the ranks "
                             "started by OpenMPI's mpirun, faster on dedicated cores "
                             "(default: gloo)")
    parser.add_argument("--servers", type=int, default=1,
                        help="ps-lite servers per node for dist_sync, p3 and dist_async "
                             "(default: 1; 0 on worker nodes when other nodes serve)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds the whole job may run; then everything is "
                             "terminated and the launcher exits 124")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="restart the whole job (every node) up to R times after a "
                             "failure, or (--nnodes MIN:MAX) after a failure or a lost "
                             "node; scripts resume from their last checkpoint")
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
    nodes = parser.add_argument_group("several machines: one launcher per node")
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
                            "srun: the first host of the job's node list)")
    nodes.add_argument("--master-port", type=int, default=DEFAULT_MASTER_PORT,
                       help=f"port of node 0's launcher (default: {DEFAULT_MASTER_PORT})")
    nodes.add_argument("--join-timeout", type=float, default=300.0, metavar="SEC",
                       help="seconds for every node to join (default: 300)")
    nodes.add_argument("--heartbeat", type=float, default=HEARTBEAT, metavar="SEC",
                       help="node 0's launcher tells the others it is alive at least every "
                            f"SEC seconds (default: {HEARTBEAT:g}; the others report every "
                            f"{STATUS_EVERY:g} s)")
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
    fan = parser.add_argument_group("several machines: one command over ssh")
    fan.add_argument("-H", "--hosts", default=None,
                     help="host1:N1,host2:N2,... start a launcher on each host over ssh")
    fan.add_argument("--hostfile", default=None,
                     help="file of lines 'host slots=N' (same as -H)")
    fan.add_argument("--ssh-port", type=int, default=None, help="ssh port of every host")
    fan.add_argument("--ssh-identity-file", default=None, help="ssh private key")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the worker command, after --")
    args = parser.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if not args.command:
        parser.error("no command given: put the worker command after --, e.g. "
                     "-- python train.py")
    if args.hosts and args.hostfile:
        parser.error("give either -H/--hosts or --hostfile, not both")
    _elastic_arguments(parser, args)
    if args.hosts or args.hostfile:
        try:
            args.host_slots = ssh.parse_hosts(args.hosts) if args.hosts \
                else ssh.read_hostfile(args.hostfile)
        except ValueError as err:
            parser.error(str(err))
        if (args.nnodes is not None and not args.elastic) or args.node_rank is not None:
            parser.error("-H/--hostfile starts one launcher per host itself; do not add "
                         "--nnodes or --node-rank (except --nnodes MIN:MAX, which makes "
                         "the job elastic)")
        if args.elastic and len(args.host_slots) > args.max_nodes:
            parser.error(f"-H/--hostfile names {len(args.host_slots)} hosts, more than "
                         f"the MAX {args.max_nodes} of --nnodes")
        if args.num_workers is None:
            args.num_workers = max(host.slots for host in args.host_slots)
    if args.num_workers is None:
        parser.error("-n is required: the number of workers per node")
    if args.num_workers < 0:
        parser.error(_AT_LEAST_ONE_WORKER.format(args.num_workers))
    if args.servers < 0:
        parser.error(_AT_LEAST_ONE_SERVER.format(args.servers))
    if args.transport == "mpi" and args.backend != "horovod":
        parser.error(f"--transport mpi is for --backend horovod, not {args.backend}")
    if args.transport == "mpi" and not mpi.mpirun_path():
        parser.error("--transport mpi needs OpenMPI's mpirun on PATH (Debian: apt-get "
                     "install openmpi-bin libopenmpi-dev, then `make setup` rebuilds "
                     "horovod with MPI); or use --transport gloo")
    if args.max_restarts < 0:
        parser.error(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if args.stacks_signal is not None:
        try:
            jobcontrol.stacks_signal({"DG_STACKS_SIGNAL": args.stacks_signal})
        except ValueError as err:
            parser.error(f"--stacks-signal: {err}")
        # the workers, the node launchers and mpirun's ranks inherit it (DG_* is passed on)
        os.environ["DG_STACKS_SIGNAL"] = args.stacks_signal
    if args.compat is not None:
        # node.py puts the stand-in packages on the workers' PYTHONPATH; the node
        # launchers and mpirun's ranks inherit it (DG_* is passed on)
        os.environ[COMPAT_ENV] = args.compat
    if not 0 < args.heartbeat < args.silence_limit:
        parser.error(f"--heartbeat ({args.heartbeat:g}) must be positive and shorter than "
                     f"--silence-limit ({args.silence_limit:g})")
    for name in ("timeout", "stall_timeout", "join_timeout", "preempt_grace"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {value:g}")
    if args.stall_warning is not None and args.stall_warning < 0:
        parser.error(f"--stall-warning must be >= 0, got {args.stall_warning:g}")
    if args.stall_warning == 0:
        args.stall_warning = None
    if not 0 < args.master_port < 65536:
        parser.error(f"--master-port must be in [1, 65535], got {args.master_port}")
    if not (args.hosts or args.hostfile):
        _node_arguments(parser, args)
    _server_arguments(parser, args)
    return args


_AT_LEAST_ONE_WORKER = ("-n must be at least 1 (0 only on a node of a ps-lite job of several "
                        "nodes that runs servers alone), got {}")
_AT_LEAST_ONE_SERVER = ("--servers must be at least 1 (0 only on worker nodes of a job of "
                        "several nodes whose other nodes serve), got {}")


def _elastic_arguments(parser, args) -> None:
    """--nnodes N or MIN:MAX: ``args.elastic``, ``args.min_nodes``, ``args.max_nodes``,
    and ``args.nnodes`` as an int (MAX for an elastic job), or None when not given."""
    text = args.nnodes
    args.elastic = text is not None and ":" in text
    args.min_nodes = args.max_nodes = None
    if text is None:
        return
    low, _, high = text.partition(":")
    try:
        args.min_nodes = int(low)
        args.max_nodes = int(high) if args.elastic else args.min_nodes
    except ValueError:
        parser.error(f"--nnodes must be a number of nodes N or a range MIN:MAX (e.g. "
                     f"2:4), got {text!r}")
    if args.elastic and not 1 <= args.min_nodes <= args.max_nodes:
        parser.error(f"--nnodes MIN:MAX needs 1 <= MIN <= MAX, got {text!r}")
    args.nnodes = args.max_nodes
    if not args.elastic:
        return
    if args.transport == "mpi":
        parser.error("--nnodes MIN:MAX needs --transport gloo: mpirun starts a fixed set "
                     "of ranks, which cannot change while the job runs")
    if args.last_call < 0:
        parser.error(f"--last-call must be >= 0, got {args.last_call:g}")


def _server_arguments(parser, args) -> None:
    """Nodes that only serve or only work (ps-lite): -n 0 or --servers 0 on one node,
    hosts with 0 slots in -H/--hostfile, or --server-nodes K for the last K nodes."""
    pslite = args.backend != "horovod"
    if args.hosts or args.hostfile:
        if args.server_nodes is not None:
            parser.error("--server-nodes is for one launcher per node; with -H/--hostfile "
                         "give each server-only host 0 slots and its servers: host:0:S, "
                         "or 'host slots=0 servers=S'")
        if not pslite and any(host.slots == 0 for host in args.host_slots):
            parser.error("a host with 0 slots only runs ps-lite servers, and --backend "
                         "horovod has none: use --backend dist_sync, p3 or dist_async")
        servers = sum(args.servers if host.servers is None else host.servers
                      for host in args.host_slots)
        if pslite and servers < 1:
            parser.error("the hosts run no ps-lite server: give some host servers "
                         "(host:N:S, 'servers=S' in a hostfile, or --servers)")
        return
    if args.elastic and args.node_rank == 0 and args.num_workers == 0:
        parser.error("node 0 of an elastic job must run workers: rank 0, which writes the "
                     "checkpoints, lives on node 0, the one node the job cannot lose")
    if args.server_nodes is not None:
        if args.elastic:
            parser.error("--server-nodes counts nodes from the end of a fixed set; in an "
                         "elastic job give the server-only nodes -n 0 --servers S instead")
        if not pslite:
            parser.error("--server-nodes needs a ps-lite backend (dist_sync, p3 or "
                         "dist_async); horovod has no servers")
        if not 0 < args.server_nodes < args.nnodes:
            parser.error(f"--server-nodes must be in [1, {args.nnodes - 1}] (some nodes "
                         f"must run workers), got {args.server_nodes}")
        if args.servers < 1:
            parser.error(_AT_LEAST_ONE_SERVER.format(args.servers))
        if args.node_rank >= args.nnodes - args.server_nodes:
            args.num_workers = 0
        else:
            args.servers = 0
    if args.nnodes == 1 and args.num_workers == 0:
        parser.error(_AT_LEAST_ONE_WORKER.format(0))
    if args.num_workers == 0 and not pslite:
        parser.error("-n 0 makes a node that only runs ps-lite servers, and --backend "
                     "horovod has none: use --backend dist_sync, p3 or dist_async")
    if args.nnodes == 1 and args.servers == 0 and pslite:
        parser.error(_AT_LEAST_ONE_SERVER.format(0))
    if args.num_workers == 0 and args.servers == 0:
        parser.error("-n 0 with --servers 0: this node would run neither workers nor "
                     "servers")


def _node_arguments(parser, args) -> None:
    """--nnodes/--node-rank/--master-addr, with SLURM's values as defaults under srun."""
    try:
        defaults = slurm.defaults(os.environ)
    except ValueError as err:
        if args.nnodes is None:
            parser.error(str(err))
        defaults = None     # --nnodes given: the launcher does not rely on SLURM's count
    if defaults:
        # under srun SLURM names this node and node 0, and counts the nodes unless
        # --nnodes (e.g. MIN:MAX) is given
        if args.nnodes is None:
            args.nnodes = defaults["nnodes"]
        if args.node_rank is None:
            args.node_rank = defaults["node_rank"]
        if args.master_addr is None:
            args.master_addr = defaults["master_addr"]
    if args.nnodes is None:
        args.nnodes = 1
    if not args.elastic:
        args.min_nodes = args.max_nodes = args.nnodes
    args.node_rank = 0 if args.node_rank is None else args.node_rank
    if args.nnodes < 1:
        parser.error(f"--nnodes must be at least 1, got {args.nnodes}")
    if not 0 <= args.node_rank < args.nnodes:
        parser.error(f"--node-rank must be in [0, {args.nnodes}), got {args.node_rank}"
                     + (" (node ranks of an elastic job range up to its MAX nodes; a node "
                        "that joins late takes a rank no node of the job has now)"
                        if args.elastic else ""))
    if args.nnodes > 1 and not args.master_addr:
        parser.error("--nnodes > 1 needs --master-addr: the address of node 0, reachable "
                     "from every node")
    try:
        args.job_secret = (secret.read_from_stdin() if os.environ.get(ssh.PARENT_ENV) == "ssh"
                           else secret.for_node(args.job_secret_file, os.environ, args.nnodes))
    except ValueError as err:
        parser.error(str(err))


class _Output:
    """The launcher's own messages, prefixed so they stand out from the workers'."""

    def __init__(self, nnodes: int, node_rank: int):
        self.prefix = "dist_gluon.launch: " if nnodes == 1 \
            else f"dist_gluon.launch[node {node_rank}]: "

    def say(self, text: str) -> None:
        output.emit("".join(f"{self.prefix}{line}\n" for line in text.splitlines()))


# ---------------------------------------------------------------------- entry point
def _watch_stdin() -> None:
    """Started over ssh by a launcher with -H: end when that launcher goes away (the
    ssh channel closes, which no signal reports)."""
    def watch():
        try:
            while os.read(0, 4096):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, daemon=True).start()


def main(argv=None) -> int:
    status = _main(argv)
    # every line written before the exit status, unless nobody reads the output: then
    # exit anyway (Python's own flush at exit would block too)
    if not output.drain(timeout=10.0):
        os._exit(status)
    return status


def _main(argv=None) -> int:
    args = _parse_args(sys.argv[1:] if argv is None else argv)
    if args.hosts or args.hostfile:
        return ssh.run(args)
    out = _Output(args.nnodes, args.node_rank)

    def on_signal(signum, frame):
        raise Interrupted(signum)

    # elastic: SIGTERM is a preemption notice (the node leaves after a checkpoint)
    preemption = Preemption() if args.elastic else None
    handlers = {signal.SIGINT: on_signal,
                signal.SIGTERM: preemption.handler if preemption else on_signal}
    previous = {s: signal.signal(s, h) for s, h in handlers.items()}
    if os.environ.get(ssh.PARENT_ENV) == "ssh":
        _watch_stdin()
    try:
        if args.node_rank == 0:
            return Master(args, out, preemption).run()
        return Agent(args, out, preemption).run()
    except Interrupted as stop:
        out.say(f"interrupted by {signal.Signals(stop.signum).name}")
        return 128 + stop.signum
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
