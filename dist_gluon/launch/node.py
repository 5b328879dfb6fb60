"""The processes of one node of a job: its workers (and, for ps-lite, its servers and on
node 0 the scheduler), their job-control records, and their environment."""
from __future__ import annotations

import functools
import os
import signal
import socket
import sys
import tempfile
import time

from .. import jobcontrol
from . import jobenv, mpi, secret, standby, statedir
from .config import LaunchConfig
from .processes import TERM_GRACE, Process, terminate
from .protocol import RoundSpec

STACKS_WAIT = 1.0       # seconds a worker gets to dump its stacks
KEPT_GRACE = 1.0        # seconds from SIGTERM to SIGKILL for what a kept round ends
# Seconds a worker kept from the round before has to enter the round it was handed
# (dist_gluon.elastic.run polls for it every 10 ms once its collectives failed). One
# that does not is alive but does not run (stopped, or stuck outside a collective) and
# every other worker waits for it at the round's rendezvous: it is killed, and the next
# round replaces it. DG_ENTER_LIMIT (seconds) overrides it.
ENTER_LIMIT = 60.0
# how many of its last keys a worker whose count stands still reports: a stall's
# collectives are the keys one rank has among them and another has not (supervisor.py);
# MXNet's engine may submit a step's collectives in another order than the script's
RECENT_KEYS = 32
# Gloo's timeout (HOROVOD_GLOO_TIMEOUT_SECONDS) in elastic horovod jobs: how long a
# collective may wait for a peer. A survivor's horovod thread can be left waiting in a
# Gloo send to a peer that vanished, which no broken socket wakes (measured: the whole
# default 30 s); joining the next round in the same process waits for that thread.
# Every worker of such a job first meets the others at the rendezvous
# (dist_gluon.backends.horovod), so hvd.init() itself never waits for a slow starter.
ELASTIC_GLOO_TIMEOUT = 5
# --compat byteps: stand-ins for the peers' packages (dist_gluon/compat/_shims), first on
# the workers' PYTHONPATH, so that an unchanged `import byteps.mxnet` finds
# dist_gluon.compat.byteps
COMPAT_ENV = "DG_COMPAT"
_COMPAT_SHIMS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                             "compat", "_shims")


@functools.cache
def _gloo_iface(addr: str) -> str:
    """jobenv.gloo_iface, asked once per address of the job's host: it runs ``ip``, and
    every node of a job that re-forms asked it again at the same moment."""
    return jobenv.gloo_iface(addr)


def free_port(bind_addr: str = "") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((bind_addr, 0))
        return sock.getsockname()[1]


class Node:
    """One run (one restart) of this node's processes.

    ``spec`` is what node 0 decided for this run, the same on every node
    (:class:`~dist_gluon.launch.protocol.RoundSpec`); ``node_rank`` is this node's
    position in the formation; ``config`` this launcher's settings (the worker command,
    --iface, the job secret). ``kept``: the node's processes of the round before, kept
    through the re-formation (:meth:`end_round`): its live workers that keep their
    process (dist_gluon.elastic.run) are handed this round in place of new ones.
    """

    def __init__(self, config: LaunchConfig, node_rank: int, spec: RoundSpec,
                 kept: Node | None = None):
        self.config, self.node_rank, self.spec = config, node_rank, spec
        self.host = socket.gethostname()
        self.processes: list[Process] = []
        self._records: dict[int, jobcontrol.Record] = {}
        self._stacks_files: dict[int, str] = {}
        self._stack_offsets: dict[int, int] = {}
        root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        statedir.remove_orphan_controls(root)
        self._control_dir = statedir.make_control_dir(root)
        # a kept worker's record stays in its first round's directory
        self._dirs = [self._control_dir] + (kept._dirs if kept is not None else [])
        self._kept = kept
        # the workers' environment, for the standbys of the next round (standby.py)
        self._base: dict[str, str] | None = None
        self._warm = warm_standbys(config, spec)     # asked once: it looks up PATH
        self._warmed = not self._warm
        self._training_since: float | None = None
        # each worker's collective count at the last states(): a worker whose count has
        # not moved since reports its last keys, which name a stall's collectives
        self._counts_seen: dict[int, int] = {}
        # kept workers handed this round and not known to have entered it: when
        self._handed: dict[int, float] = {}
        self._enter_limit = float(os.environ.get("DG_ENTER_LIMIT", ENTER_LIMIT))
        # why this launcher killed a worker (it did not enter its round), by rank
        self._killed_why: dict[int, str] = {}

    @property
    def nproc(self) -> int:
        """This node's workers (0 on a node that only runs ps-lite servers)."""
        return self.spec.slots[self.node_rank]

    @property
    def first_rank(self) -> int:
        # ranks are numbered node by node, over the nodes that run workers
        return sum(self.spec.slots[:self.node_rank])

    @property
    def ranks(self) -> list[int]:
        return list(range(self.first_rank, self.first_rank + self.nproc))

    # ------------------------------------------------------------------ start
    def start(self) -> None:
        spec = self.spec
        nproc, nnodes = self.nproc, spec.nnodes
        base = dict(os.environ)
        base.pop(secret.ENV, None)      # the launchers' alone
        base.setdefault("PYTHONUNBUFFERED", "1")
        base.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, nproc))))
        base.update({"DG_NUM_WORKERS": str(spec.num_workers), "DG_BACKEND": spec.backend,
                     "DG_RESTART": str(spec.restart), "DG_NNODES": str(nnodes),
                     "DG_REFORMATION": str(spec.reformation),
                     "DG_NODE_RANK": str(self.node_rank),
                     jobcontrol.ENV_DIR: self._control_dir})
        if spec.elastic:
            base["DG_ELASTIC"] = "1"        # dist_gluon.stop_requested() asks every rank
        if base.get(COMPAT_ENV):
            base["PYTHONPATH"] = os.pathsep.join(
                p for p in (_COMPAT_SHIMS, base.get("PYTHONPATH")) if p)
        if spec.elastic and spec.job and spec.backend != "horovod":
            # ps-lite workers restart on every change of the job: their state outlives
            # them in the node's shared memory (dist_gluon.elastic.nodecopy)
            base[statedir.ENV_DIR] = statedir.for_job(spec.job, self.config.node_rank)
            base[statedir.ENV_JOB] = spec.job
        if spec.keep or spec.memory:
            # the workers of this round get their state from the workers kept, or from
            # the nodes' copies in memory (dist_gluon.elastic.State.sync), not from the
            # broadcast of a new job's model
            base["DG_ELASTIC_HEAL"] = "1"
        self._base = base
        kept, self._kept = self._adoptable(), None
        try:
            if spec.backend == "horovod":
                self._start_horovod(base, kept)
            else:
                self._start_pslite(base)
        finally:
            terminate([p for p, _, _ in kept.values()], KEPT_GRACE)

    def _worker_env(self, base, local_rank):
        rank = self.first_rank + local_rank
        path = jobcontrol.create_record(self._control_dir, rank)
        self._records[rank] = jobcontrol.Record(path)
        self._stacks_files[rank] = jobcontrol.stacks_path(self._control_dir, rank)
        return rank, dict(base, DG_RANK=str(rank), DG_LOCAL_RANK=str(local_rank))

    # ------------------------------------------------------------------ kept workers
    def _adoptable(self) -> dict[int, tuple[Process, jobcontrol.Record, str]]:
        """The kept round's live workers that keep their process, by local rank; its
        other processes end (ps-lite's services, a worker that failed)."""
        kept = self._kept
        if kept is None:
            return {}
        found, rest = {}, []
        for p in kept.processes:
            record = kept._records.get(p.rank) if p.role == "worker" else None
            if record is not None and p.returncode is None and record.attached \
                    and record.keeps and record.exception is None:
                found[p.local_rank] = (p, record, kept._stacks_files[p.rank])
            else:
                rest.append(p)
        terminate(rest, KEPT_GRACE)
        return found

    def _adopt(self, kept, base, local_rank: int, environ: dict) -> None:
        """Hand a kept worker this round: its rank, and the round's variables."""
        p, record, stacks = kept.pop(local_rank)
        rank = self.first_rank + local_rank
        env = {k: v for k, v in base.items() if k.startswith("DG_")
               and k not in (jobcontrol.ENV_DIR, "DG_ELASTIC_HEAL")}
        env.update(environ, DG_RANK=str(rank), DG_LOCAL_RANK=str(local_rank))
        p.rank, p.label = rank, str(rank)
        self._records[rank], self._stacks_files[rank] = record, stacks
        self.processes.append(p)
        record.hand_round(self.spec.restart, env)
        self._handed[rank] = time.monotonic()

    def end_round(self) -> None:
        """End the round for workers that keep their process: they break the round's
        pending collectives, go back to their last commit and wait for the next round
        (dist_gluon.elastic.run). The node's other processes end."""
        others = [p for p in self.processes if p.role != "worker"
                  or not self._records[p.rank].keeps]
        terminate(others, KEPT_GRACE)
        for p in self.workers:
            if p.returncode is None and self._records[p.rank].keeps:
                self._records[p.rank].end_round(self.spec.restart)

    def commits_to_node(self) -> bool:
        """Whether this node's workers all commit their state to the node's shared
        memory (dist_gluon.elastic.run on ps-lite)."""
        return bool(self.workers) and all(self._records[p.rank].node_copy
                                          for p in self.workers)

    def keeps(self) -> bool:
        """Whether this node's live workers all keep their processes."""
        live = [p for p in self.workers if p.returncode is None]
        return bool(live) and all(self._records[p.rank].keeps for p in live)

    def _start_horovod(self, base, kept):
        spec = self.spec
        if spec.transport == "mpi":
            mpi.start(self, base)
            return
        nproc, nnodes = spec.nproc, spec.nnodes
        # a job of several nodes re-formed on one still has its rendezvous on the host's
        # address, not on loopback
        if nnodes == 1 and not self.config.several_nodes:
            addr, iface, label = "127.0.0.1", "lo", "localhost"
        else:
            addr = socket.gethostbyname(spec.master_addr)
            iface = self.config.iface or _gloo_iface(addr)
            label = self.host
        for local_rank in range(nproc):
            layout = jobenv.worker_layout([nproc] * nnodes, self.node_rank, local_rank)
            horovod = jobenv.horovod_worker_env(
                addr, spec.rendezvous_port, iface, label, **layout._asdict(),
                rendezvous_token=secret.rendezvous_token(self.config.job_secret,
                                                         spec.to_wire()),
                timeout_seconds=ELASTIC_GLOO_TIMEOUT if spec.elastic
                and "HOROVOD_GLOO_TIMEOUT_SECONDS" not in base else None)
            if local_rank in kept:
                self._adopt(kept, base, local_rank, horovod)
                continue
            rank, env = self._worker_env(base, local_rank)
            env.update(horovod)
            self._spawn(str(rank), "worker", rank, list(self.config.command), env)
            self.processes[-1].local_rank = local_rank

    def _start_pslite(self, base):
        spec = self.spec
        nproc, nnodes = self.nproc, spec.nnodes
        counts = spec.server_counts
        if nnodes == 1:
            root, node_host = "127.0.0.1", "127.0.0.1"
        else:
            # ZeroMQ binds and connects numeric addresses only
            root = socket.gethostbyname(spec.master_addr)
            node_host = jobenv.route_source_addr(root)
        common = dict(base)
        common.update(jobenv.pslite_env(root, spec.scheduler_port, spec.num_workers,
                                        sum(counts), node_host,
                                        p3=spec.backend == "p3"))
        # MXNet's library without its Python package (about 3 s of CPU less per process)
        service = [sys.executable, "-m", "dist_gluon.launch.pslite_service"]
        if self.node_rank == 0:
            self._spawn("scheduler", "scheduler", None, service,
                        jobenv.scheduler_env(common))
        for s in range(counts[self.node_rank]):
            index = sum(counts[:self.node_rank]) + s
            self._spawn(f"server{index}", "server", None, service,
                        dict(common, **jobenv.pslite_role_env("server")))
        for local_rank in range(nproc):
            rank, env = self._worker_env(common, local_rank)
            env.update(jobenv.pslite_role_env("worker"))
            self._spawn(str(rank), "worker", rank, list(self.config.command), env)

    def _spawn(self, label, role, rank, argv, env):
        if role == "worker" and self._warm:
            warm = standby.pool().take(label, rank, argv, env)
            if warm is not None:
                self.processes.append(warm)
                return
        try:
            self.processes.append(Process(label, role, rank, argv, env))
        except OSError as err:
            raise SystemExit(f"dist_gluon.launch: cannot start {argv[0]!r}: {err}") from err

    def _warm_up(self) -> None:
        """Once every worker of this node has trained for standby.WARM_AFTER seconds
        past its first collective (its start is over, and the standbys' imports do not
        slow it; a job that ends sooner never pays for them), start one standby per
        worker for the next round (standby.py)."""
        if self._warmed or self._base is None:
            return
        workers = self.workers
        records = [self._records.get(p.rank) for p in workers]
        if not (workers and all(r is not None and r.attached and r.count > 0
                                for r in records)):
            return
        now = time.monotonic()
        if self._training_since is None:
            self._training_since = now
        if now - self._training_since >= standby.WARM_AFTER:
            self._warmed = True
            standby.pool().fill(len(workers), self._base)

    # ------------------------------------------------------------------ watching
    @property
    def workers(self) -> list[Process]:
        return [p for p in self.processes if p.role == "worker"]

    def _kill_absent(self) -> None:
        """Kill the kept workers that have not entered the round they were handed
        within ENTER_LIMIT seconds (see there)."""
        limit, now = self._enter_limit, time.monotonic()
        for p in self.workers:
            handed = self._handed.get(p.rank)
            if handed is None:
                continue
            if p.returncode is not None or self._records[p.rank].parked is None:
                del self._handed[p.rank]            # it entered the round, or ended
            elif now - handed >= limit:
                del self._handed[p.rank]
                self._killed_why[p.rank] = (
                    f"it did not enter round {self.spec.restart} within {limit:g} s of "
                    "being handed it, and every other worker waited for it: its process "
                    "was alive but did not run (stopped, or stuck outside a collective)")
                p.signal_group(signal.SIGKILL)

    def states(self, hint: int = 0) -> list[dict]:
        """The state of each of this node's workers (see supervisor.py); ``hint`` is the
        lowest collective count in the job, whose next key reports name."""
        self._warm_up()
        self._kill_absent()
        states = []
        now = time.time()
        beat = time.monotonic()
        for p in self.workers:
            record = self._records[p.rank]
            # the launcher's heartbeat to its departing workers (jobcontrol)
            record.stamp(beat)
            attached = record.attached
            count = record.count if attached else 0
            phase = record.phase if attached else 0
            left = p.returncode is not None or phase == jobcontrol.DEPARTING
            # How long ago the rank left, by this host's clock alone: node 0 turns it
            # into a time on its own clock when the report arrives, so the ranks of
            # hosts whose clocks disagree are still ordered right (supervisor.py).
            left_wall = (record.departed_at if attached else None) or p.ended_at
            still = self._counts_seen.get(p.rank) == count
            self._counts_seen[p.rank] = count
            states.append({
                "rank": p.rank, "host": self.host, "node": self.node_rank,
                "attached": attached, "count": count, "phase": phase,
                "departed_at": record.departed_at if attached else None,
                "exception": record.exception if attached else None,
                "returncode": p.returncode, "ended_at": p.ended_at,
                "left_age": None if left_wall is None else max(0.0, now - left_wall),
                "tail": list(p.tail) if left or (attached and record.exception) else [],
                "key_next": record.key(hint + 1) if attached else None,
                "key_last": record.key(count) if attached else None,
                "keys_recent": record.keys(RECENT_KEYS)
                if attached and count and still else None,
                "acked": attached and record.stop_acknowledged,
                "keeps": attached and record.keeps,
                "node_copy": attached and record.node_copy,
                "holds_state": attached and record.holds_state,
                "parked": attached and record.parked is not None,
                "parked_round": record.parked if attached else None,
                "killed_why": self._killed_why.get(p.rank),
                # kept and handed this round, not entered yet (_kill_absent)
                "entering": p.rank in self._handed,
                "saved": [record.saves, *record.saved_position]
                if attached and record.saves else None,
            })
        return states

    def process_report(self) -> list[str]:
        """Lines naming this node's live processes that are stopped or in
        uninterruptible sleep (the kernel's state in /proc), for a stall report."""
        states = {"T": "stopped (SIGSTOP, or a debugger: `kill -CONT` resumes it)",
                  "t": "stopped by a debugger",
                  "D": "in uninterruptible sleep (waiting for a disk or a mount)"}
        lines = []
        for p in self.processes:
            if p.returncode is not None:
                continue
            try:
                with open(f"/proc/{p.popen.pid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if state in states:
                what = f"rank {p.rank}" if p.role == "worker" else f"ps-lite {p.label}"
                lines.append(f"{what} (pid {p.popen.pid} on {self.host}) is {states[state]}")
        return lines

    def service_failure(self, workers_running: bool) -> str | None:
        """A report when a scheduler or server failed while workers still needed it."""
        if not workers_running:
            return None
        for p in self.processes:
            if p.role != "worker" and p.returncode not in (None, 0):
                end = (f"killed by signal {-p.returncode}" if p.returncode < 0
                       else f"exit code {p.returncode}")
                lines = [f"ps-lite {p.label} on {self.host} failed ({end}) while workers "
                         "still needed it."]
                if p.tail:
                    lines.append(f"last lines of {p.label}'s stderr:")
                    lines.extend(f"    {line}" for line in p.tail)
                return "\n".join(lines)
        return None

    def services_ended(self) -> bool:
        return all(p.returncode is not None for p in self.processes if p.role != "worker")

    def set_verdicts(self, verdicts: dict[int, int]) -> None:
        for rank, verdict in verdicts.items():
            record = self._records.get(int(rank))
            if record is not None:
                record.set_verdict(verdict)

    def request_stop(self, number: int) -> None:
        """Ask every worker of this node to stop at its next step boundary (elastic)."""
        for record in self._records.values():
            record.request_stop(number)

    def stacks(self, ranks: list[int]) -> dict[int, str]:
        """Ask the given local ranks for their Python stacks and return what they wrote."""
        asked = []
        for p in self.workers:
            record = self._records[p.rank]
            if p.rank in ranks and record.attached and p.returncode is None:
                path = self._stacks_files[p.rank]
                self._stack_offsets[p.rank] = os.path.getsize(path)
                try:
                    os.kill(record.pid, jobcontrol.stacks_signal())
                    asked.append(p.rank)
                except ProcessLookupError:
                    pass
        if asked:
            time.sleep(STACKS_WAIT)
        found = {}
        for rank in asked:
            with open(self._stacks_files[rank]) as f:
                f.seek(self._stack_offsets[rank])
                found[rank] = f.read()
        return found

    def terminate(self, grace: float = TERM_GRACE) -> None:
        """End every process: SIGTERM, then SIGKILL after ``grace`` seconds."""
        # an elastic job's workers take SIGTERM as a request to stop at a step boundary;
        # from their launcher it means now
        self.request_stop(jobcontrol.TERMINATING)
        terminate(self.processes, grace)
        for directory in self._dirs:
            statedir.remove_dir(directory)

    def interrupt(self) -> None:
        for p in self.processes:
            p.signal_group(signal.SIGTERM)


def warm_standbys(config: LaunchConfig, spec: RoundSpec) -> bool:
    """Whether this launcher's workers may be restarted and a standby can take their
    place (standby.py): a job with restarts or elastic, whose command runs this
    launcher's Python on a script or module, not started by mpirun."""
    return bool(config.warm_standby and (config.max_restarts or config.elastic)
                and not (spec.backend == "horovod" and spec.transport == "mpi")
                and standby.takes_over(config.command))
