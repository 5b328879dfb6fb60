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

The launcher is a process supervisor: it imports neither mxnet nor horovod. Its modules:
cli.py (arguments -> one frozen LaunchConfig, config.py), job.py (the job loop, in
rounds), master.py (node 0), agent.py (the other nodes), formation.py (which nodes make
up the job), rounds.py (one round, watched), policy.py (restarts, admission and
re-formation as pure functions), protocol.py (the launchers' messages), channel.py (their
authenticated link), supervisor.py (judging the ranks), node.py (one node's processes),
jobenv.py and rendezvous.py (what a backend's workers need), ssh.py, slurm.py, mpi.py.
"""
from __future__ import annotations

import os
import signal
import sys
import threading

from .. import timeline
from . import cli, observe, output, ssh, standby, statedir
from .agent import Agent
from .config import LaunchConfig
from .job import Interrupted, Preemption
from .master import Master
from .node import COMPAT_ENV


def _parse_args(argv: list[str]) -> LaunchConfig:
    """The launcher's configuration from its arguments (see cli.parse)."""
    return cli.parse(argv)


def _export(config: LaunchConfig) -> None:
    """What every process of the job inherits from this launcher's environment: the
    workers, the node launchers over ssh and mpirun's ranks (DG_* is passed on)."""
    if config.stacks_signal is not None:
        os.environ["DG_STACKS_SIGNAL"] = config.stacks_signal
    if not config.tune:
        os.environ["DG_TUNE"] = "0"
    if config.compat is not None:
        # node.py puts the stand-in packages on the workers' PYTHONPATH
        os.environ[COMPAT_ENV] = config.compat
    # node 0's launcher observes its own workers (observe.py); a directory named by
    # another host's launcher means nothing here
    for name in (timeline.ENV_DIR, timeline.ENV_LEVEL):
        os.environ.pop(name, None)


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
    config = cli.parse(sys.argv[1:] if argv is None else argv)
    _export(config)
    if config.over_ssh:
        return ssh.run(config)
    out = _Output(config.nnodes, config.node_rank)
    observation = None
    if config.report != "off" or config.timeline:
        # node 0 observes the job; another node forwards its ranks' step records
        observation = observe.Observation(config.timeline, config.report,
                                          config.report_every, out,
                                          forwarding=config.node_rank != 0,
                                          asynchronous=config.backend == "dist_async")
        os.environ.update(observation.environ())
        # what any node's launcher says goes on the timeline too
        out = observation

    def on_signal(signum, frame):
        raise Interrupted(signum)

    # elastic: SIGTERM is a preemption notice (the node leaves after a checkpoint)
    # (a job on one machine is elastic only to recover in memory: SIGTERM ends it)
    preemption = Preemption() if config.elastic and not config.one_machine else None
    handlers = {signal.SIGINT: on_signal,
                signal.SIGTERM: preemption.handler if preemption else on_signal}
    previous = {s: signal.signal(s, h) for s, h in handlers.items()}
    if os.environ.get(ssh.PARENT_ENV) == "ssh":
        _watch_stdin()
    try:
        if config.node_rank == 0:
            return Master(config, out, preemption).run()
        return Agent(config, out, preemption, observation).run()
    except Interrupted as stop:
        out.say(f"interrupted by {signal.Signals(stop.signum).name}")
        return 128 + stop.signum
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        # the node's copy of the workers' state in memory ends with the launcher
        statedir.remove()
        standby.pool().close()
        if observation is not None:
            observation.finish()
