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
import queue
import signal
import socket
import sys
import threading
import time

from .. import jobcontrol, jobenv
from .._version import __version__
from ..rendezvous import GlooRendezvous
from . import channel, mpi, output, secret, slurm, ssh
from .channel import HEARTBEAT, SILENCE, JoinError, Link, accept_nodes, connect_to_master
from .node import COMPAT_ENV, Node, free_port
from .supervisor import Supervisor

BACKENDS = ("horovod", "dist_sync", "p3", "dist_async")
SERVICE_GRACE = 10.0    # seconds ps-lite's scheduler and servers get after the workers
STATUS_EVERY = 0.1      # seconds between a node's status reports
DEFAULT_MASTER_PORT = 29500


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
                             "failure; scripts resume from their last checkpoint")
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
    nodes.add_argument("--nnodes", type=int, default=None,
                       help="number of nodes (default: 1, or SLURM's node count under srun)")
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
    if args.hosts or args.hostfile:
        try:
            args.host_slots = ssh.parse_hosts(args.hosts) if args.hosts \
                else ssh.read_hostfile(args.hostfile)
        except ValueError as err:
            parser.error(str(err))
        if args.nnodes is not None or args.node_rank is not None:
            parser.error("-H/--hostfile starts one launcher per host itself; do not add "
                         "--nnodes or --node-rank")
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
    for name in ("timeout", "stall_timeout", "join_timeout"):
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
    if args.server_nodes is not None:
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
        defaults = slurm.defaults(os.environ) if args.nnodes is None else None
    except ValueError as err:
        parser.error(str(err))
    if defaults:
        args.nnodes = defaults["nnodes"]
        if args.node_rank is None:
            args.node_rank = defaults["node_rank"]
        if args.master_addr is None:
            args.master_addr = defaults["master_addr"]
    args.nnodes = 1 if args.nnodes is None else args.nnodes
    args.node_rank = 0 if args.node_rank is None else args.node_rank
    if args.nnodes < 1:
        parser.error(f"--nnodes must be at least 1, got {args.nnodes}")
    if not 0 <= args.node_rank < args.nnodes:
        parser.error(f"--node-rank must be in [0, {args.nnodes}), got {args.node_rank}")
    if args.nnodes > 1 and not args.master_addr:
        parser.error("--nnodes > 1 needs --master-addr: the address of node 0, reachable "
                     "from every node")
    try:
        args.job_secret = (secret.read_from_stdin() if os.environ.get(ssh.PARENT_ENV) == "ssh"
                           else secret.for_node(args.job_secret_file, os.environ, args.nnodes))
    except ValueError as err:
        parser.error(str(err))


class _Interrupted(Exception):
    def __init__(self, signum):
        self.signum = signum


class _Output:
    """The launcher's own messages, prefixed so they stand out from the workers'."""

    def __init__(self, nnodes: int, node_rank: int):
        self.prefix = "dist_gluon.launch: " if nnodes == 1 \
            else f"dist_gluon.launch[node {node_rank}]: "

    def say(self, text: str) -> None:
        output.emit("".join(f"{self.prefix}{line}\n" for line in text.splitlines()))


# ---------------------------------------------------------------------- node 0
class _JobView:
    """What the supervisor sees: this node's ranks and the latest reports of the
    others; and the way its verdicts and requests reach every node."""

    def __init__(self, node: Node, links: dict[int, Link], out: _Output):
        self.node, self.links, self.out = node, links, out
        self.remote: dict[int, dict] = {n: {"states": [], "service_failure": None,
                                            "services_ended": False} for n in links}
        self.lost: list[int] = []
        self.hint = 0
        self._stacks: dict[int, str] = {}

    def pump(self, timeout: float = 0.0) -> None:
        """Take in every message that has arrived from the other nodes."""
        limit = time.monotonic() + timeout
        while True:
            got = False
            for n, link in self.links.items():
                try:
                    message = link.inbox.get_nowait()
                except queue.Empty:
                    continue
                got = True
                if message is None:
                    if n not in self.lost:
                        self.lost.append(n)
                elif message["type"] == "status":
                    message["received"] = time.monotonic()
                    self.remote[n] = message
                elif message["type"] == "stacks":
                    self._stacks.update({int(r): t for r, t in message["found"].items()})
            if not got and time.monotonic() >= limit:
                return
            if not got:
                time.sleep(0.02)

    def states(self) -> list[dict]:
        """Every rank's state; ``left_at`` is when it left on this launcher's monotonic
        clock (the reporting host's age of the news, subtracted from when it arrived
        here): no two hosts' clocks are ever compared."""
        now = time.monotonic()
        states = self.node.states(self.hint)
        for s in states:
            s["left_at"] = None if s["left_age"] is None else now - s["left_age"]
        for n in sorted(self.remote):
            received = self.remote[n].get("received", now)
            for s in self.remote[n]["states"]:
                s["left_at"] = (None if s.get("left_age") is None
                                else received - s["left_age"])
                states.append(s)
        low = min((s["count"] for s in states), default=0)
        if low != self.hint:
            self.hint = low
            self.broadcast({"type": "hint", "low": low})
        return sorted(states, key=lambda s: s["rank"])

    def broadcast(self, message: dict) -> None:
        for link in self.links.values():
            link.send(message)

    def set_verdicts(self, verdicts: dict[int, int]) -> None:
        self.node.set_verdicts(verdicts)
        self.broadcast({"type": "verdicts", "verdicts": verdicts})

    def stacks(self, ranks: list[int]) -> dict[int, str]:
        self._stacks = {}
        self.broadcast({"type": "stacks", "ranks": ranks})
        found = self.node.stacks(ranks)
        remote = [r for r in ranks if r not in found
                  and r not in self.node.ranks]
        limit = time.monotonic() + 3.0
        while remote and time.monotonic() < limit and not all(r in self._stacks
                                                              for r in remote):
            self.pump(0.1)
        found.update({r: self._stacks[r] for r in remote if r in self._stacks})
        return found

    def service_failure(self, workers_running: bool) -> str | None:
        report = self.node.service_failure(workers_running)
        if report:
            return report
        return next((r["service_failure"] for r in self.remote.values()
                     if r.get("service_failure")), None)

    def services_ended(self) -> bool:
        return self.node.services_ended() and all(r.get("services_ended")
                                                  for r in self.remote.values())

    def say(self, text: str) -> None:
        self.out.say(text)


def _job_spec(args, restart: int, master_addr: str) -> dict:
    spec = {"backend": args.backend, "nnodes": args.nnodes, "nproc": args.num_workers,
            "servers": args.servers, "restart": restart, "master_addr": master_addr,
            "transport": args.transport, "hosts": getattr(args, "node_hosts", None),
            "slots": args.node_slots, "server_counts": args.node_servers}
    bind = "" if args.nnodes > 1 else "127.0.0.1"
    port = free_port(bind)
    spec["rendezvous_port" if args.backend == "horovod" else "scheduler_port"] = port
    return spec


def _node_layout(args, hellos: dict[int, dict]) -> str | None:
    """Each node's workers and ps-lite servers (``args.node_slots``,
    ``args.node_servers``), from node 0's arguments and the other nodes' hellos; or
    what is wrong with them. Ranks are numbered node by node, over the nodes that run
    workers. On horovod every node runs node 0's -n."""
    others = [hellos[n] for n in sorted(hellos)]
    if args.backend == "horovod":
        args.node_slots = [args.num_workers] * args.nnodes
        args.node_servers = [0] * args.nnodes
        return None
    args.node_slots = [args.num_workers] + [h["nproc"] for h in others]
    args.node_servers = [args.servers] + [h.get("servers", args.servers) for h in others]
    if sum(args.node_slots) < 1:
        return "no node of this job runs workers (every node was given -n 0)"
    if sum(args.node_servers) < 1:
        return ("no node of this job runs a ps-lite server (every node was given "
                "--servers 0): give the server nodes --servers S")
    return None


def _run_master(args, out: _Output) -> int:
    links: dict[int, Link] = {}
    if args.nnodes > 1:
        jobenv_error = _check_multinode_host(args)
        if jobenv_error:
            out.say(jobenv_error)
            return 1
        args.listen_addr = channel.listen_address(args.master_addr)
        out.say(f"waiting for {args.nnodes - 1} more node(s) on port {args.master_port}")
        try:
            joined = accept_nodes(args.master_port, args.nnodes, args.join_timeout, out.say,
                                  args.job_secret, args.listen_addr)
        except JoinError as err:
            out.say(str(err))
            return 1
        links = {n: link for n, (link, _) in joined.items()}
        args.node_hosts = [None] + [joined[n][1]["host"] for n in range(1, args.nnodes)]
    problem = _node_layout(args, {n: hello for n, (_, hello) in joined.items()}
                           if args.nnodes > 1 else {})
    if problem:
        for link in links.values():
            link.send({"type": "end", "status": 2, "report": problem, "again": False})
        out.say(problem)
        time.sleep(0.5)     # the links' writers deliver it before they close
        for link in links.values():
            link.close()
        return 2
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    status = 1
    try:
        for restart in range(args.max_restarts + 1):
            spec = _job_spec(args, restart, args.master_addr or "127.0.0.1")
            status, report, again = _run_once(args, spec, links, out, deadline,
                                              last=restart == args.max_restarts)
            if not again:
                return status
            out.say(f"restarting the job on every node ({restart + 1} of "
                    f"{args.max_restarts})")
        return status
    finally:
        for link in links.values():
            link.close()


def _run_once(args, spec, links, out, deadline, last: bool):
    """One run of the job on every node; returns (status, report, run again)."""
    rendezvous = None
    if spec["backend"] == "horovod":
        rendezvous = GlooRendezvous(
            (args.listen_addr or "0.0.0.0") if spec["nnodes"] > 1 else "127.0.0.1",
            spec["rendezvous_port"], secret.rendezvous_token(args.job_secret, spec), out.say)
        rendezvous.start()
    node = Node(args, 0, spec)
    view = _JobView(node, links, out)
    supervisor = Supervisor(view, args.stall_warning, args.stall_timeout)
    status, report = 1, None
    try:
        for link in links.values():
            link.send({"type": "start", "spec": spec})
        node.start()
        status, report = _supervise(args, view, supervisor, deadline)
    except _Interrupted as stop:
        status = 128 + stop.signum
        report = f"interrupted by {signal.Signals(stop.signum).name}"
        last = True
    finally:
        again = status not in (0, 124) and not last and report is not None \
            and not report.startswith("interrupted")
        view.broadcast({"type": "end", "status": status, "report": report, "again": again})
        node.terminate()
        if report:
            out.say(report if status == 0 else report + "\nterminated the rest of the job.")
        _wait_stopped(links, out)
        if rendezvous is not None:
            rendezvous.stop()
    return status, report, again


def _supervise(args, view: _JobView, supervisor: Supervisor, deadline):
    services_by, next_tick = None, 0.0
    while True:
        view.pump()
        if time.monotonic() >= next_tick:
            next_tick = time.monotonic() + args.heartbeat
            view.broadcast({"type": "tick"})
        view.lost.extend(n for n, link in view.links.items()
                         if link.gone(args.silence_limit) and n not in view.lost)
        if view.lost:
            lost = view.lost[0]
            return 1, (f"the launcher of node {lost} disconnected or went silent (its "
                       "machine, its network or its launcher died); its ranks are lost")
        states = view.states()
        running = any(s["returncode"] is None for s in states)
        failure = view.service_failure(running)
        if failure:
            return 1, failure
        decision = supervisor.check(states)
        if decision is not None and decision[0] == "fail":
            return decision[1], decision[2]
        if decision is not None and decision[0] == "ok":
            services_by = services_by or time.monotonic() + SERVICE_GRACE
            if view.services_ended() or time.monotonic() > services_by:
                return 0, None
        if deadline is not None and time.monotonic() > deadline:
            still = [f"{s['rank']}" for s in states if s["returncode"] is None]
            return 124, (f"timeout after {args.timeout:g} s. "
                         f"Ranks still running: {', '.join(still) or 'none'}")
        time.sleep(0.05)


def _wait_stopped(links: dict[int, Link], out: _Output, timeout: float = 15.0) -> None:
    limit = time.monotonic() + timeout
    for n, link in links.items():
        while not link.closed and time.monotonic() < limit:
            try:
                message = link.receive(timeout=0.2)
            except queue.Empty:
                continue
            if message is None or message.get("type") == "stopped":
                break
        else:
            if not link.closed:
                out.say(f"node {n} did not confirm that its processes ended")


def _check_multinode_host(args) -> str | None:
    """Gloo across nodes needs this host's name to resolve to a reachable address."""
    if args.backend != "horovod":
        return None
    try:
        if jobenv.resolves_to_loopback():
            host = socket.gethostname()
            return jobenv.loopback_hostname_error(host, socket.gethostbyname(host))
    except OSError as err:
        return f"this host's name {socket.gethostname()!r} does not resolve: {err}"
    return None


# ---------------------------------------------------------------------- nodes 1..M-1
def _run_agent(args, out: _Output) -> int:
    error = _check_multinode_host(args)
    if error:
        out.say(error)
        return 1
    hello = {"type": "hello", "node": args.node_rank, "host": socket.gethostname(),
             "nproc": args.num_workers, "servers": args.servers}
    try:
        link = connect_to_master(args.master_addr, args.master_port, hello,
                                 args.join_timeout, args.job_secret)
    except JoinError as err:
        out.say(str(err))
        return 1
    try:
        while True:
            message = link.receive()
            if message is None:
                out.say(link.refusal or f"lost the master launcher at {args.master_addr}:"
                        f"{args.master_port} before the job started")
                return 1
            if message["type"] == "end":
                if message.get("report"):
                    out.say(message["report"])
                return message["status"]
            if message["type"] != "start":
                continue
            status, again = _agent_run_once(args, message["spec"], link, out)
            if not again:
                return status
    finally:
        link.close()


def _agent_run_once(args, spec, link: Link, out: _Output):
    node = Node(args, args.node_rank, spec)
    hint, next_status = 0, 0.0
    try:
        node.start()
        while True:
            now = time.monotonic()
            if now >= next_status:
                next_status = now + STATUS_EVERY
                states = node.states(hint)
                running = any(s["returncode"] is None for s in states)
                link.send({"type": "status", "states": states,
                           "service_failure": node.service_failure(running),
                           "services_ended": node.services_ended()})
            try:
                message = link.receive(timeout=0.05)
            except queue.Empty:
                message = {"type": "silence"} if link.gone(args.silence_limit) else None
                if message is None:
                    continue
            if message is None or message["type"] == "silence":
                out.say(f"lost the master launcher at {args.master_addr}:{args.master_port}"
                        "; terminated this node's processes")
                return 1, False
            kind = message["type"]
            if kind == "hint":
                hint = message["low"]
            elif kind == "verdicts":
                node.set_verdicts({int(r): v for r, v in message["verdicts"].items()})
            elif kind == "stacks":
                found = node.stacks([r for r in message["ranks"] if r in node.ranks])
                link.send({"type": "stacks", "found": found})
            elif kind == "end":
                node.terminate()
                if message.get("report"):
                    end = "" if message["status"] == 0 else \
                        "\nterminated this node's processes."
                    out.say(message["report"] + end)
                link.send({"type": "stopped"})
                return message["status"], message["again"]
    except _Interrupted as stop:
        out.say(f"interrupted by {signal.Signals(stop.signum).name}; terminated this "
                "node's processes")
        return 128 + stop.signum, False
    finally:
        node.terminate()


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
        raise _Interrupted(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    if os.environ.get(ssh.PARENT_ENV) == "ssh":
        _watch_stdin()
    try:
        if args.node_rank == 0:
            return _run_master(args, out)
        return _run_agent(args, out)
    except _Interrupted as stop:
        out.say(f"interrupted by {signal.Signals(stop.signum).name}")
        return 128 + stop.signum
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
