"""What the launchers of one job say to each other over the channel (channel.py): one
dataclass per message, and the spec of a round, the same on every node.

On the wire a message is a JSON object whose ``type`` names it, e.g. ``{"type": "stop",
"number": 2}``; :meth:`Message.to_wire` makes it and :func:`from_node` / :func:`from_master`
read it back (one place for each). Optional fields left at None are not sent, so a
message reads on the wire exactly as it always has.

node -> master: :class:`Hello` (the channel adds its nonce), :class:`Status`,
:class:`StacksFound`, :class:`Stopped`, :class:`Idle` (between rounds), :class:`Preempt`
(its launcher got SIGTERM).
master -> node: :class:`Start`, :class:`Hint`, :class:`Verdicts`, :class:`StacksRequest`,
:class:`Stop` (stop at the next step boundary), :class:`News`, :class:`End`, :class:`Tick`,
:class:`Saved` (the newest checkpoint, which a node that takes over resumes from),
:class:`Welcome` (the host took the node in: the first message of every link it keeps).
member -> joiner: :class:`Redirect` (an elastic node that does not host the job sends a
launcher that joined through it on to the host).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar


class Message:
    """A message of the channel; subclasses are dataclasses that name their ``TYPE``."""

    TYPE: ClassVar[str] = ""

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"type": self.TYPE}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.metadata.get("local") or (value is None and f.metadata.get("optional")):
                continue
            wire[f.name] = value.to_wire() if isinstance(value, RoundSpec) else value
        return wire


def _optional(default=None):
    """A field that is not sent while it is None."""
    return field(default=default, metadata={"optional": True})


# ---------------------------------------------------------------------- the round
@dataclass(frozen=True)
class RoundSpec:
    """One round of the job as node 0 decided it; every node starts its processes from it.

    ``nodes`` are the node ranks of the formation in order (node 0 first); ``slots`` and
    ``server_counts`` the workers and ps-lite servers of each, in that order; ``hosts``
    their host names (None for the job's host, the first node). ``restart`` counts the
    rounds before this one (DG_RESTART), ``reformation`` the changes of the set of nodes
    (DG_REFORMATION). A horovod round has a ``rendezvous_port`` (Gloo's), a ps-lite round a
    ``scheduler_port``. An elastic round lists every node's ``addresses`` (in order: the
    address the others reach it at and the port its launcher would host the job on) and
    the ``restarts`` used of --max-restarts, so that the nodes that lose the host can
    elect the next one and go on (policy.successor). ``keep``: the workers of the round
    before keep their processes (dist_gluon.elastic.run) and are handed this round; the
    new ones get their state from them. ``memory``: the workers of the round before
    committed their state to their nodes' shared memory (dist_gluon.elastic.run on
    ps-lite); this round's workers take it from there or from a peer, not from a
    checkpoint. ``job``: the job's id, which names each node's copy of that state (the
    same from the first round to the last, across a change of host).
    """

    backend: str
    nnodes: int
    nodes: list[int]
    nproc: int
    servers: int
    restart: int
    reformation: int
    elastic: bool
    master_addr: str
    transport: str
    hosts: list[str | None]
    slots: list[int]
    server_counts: list[int]
    rendezvous_port: int | None = None
    scheduler_port: int | None = None
    addresses: list[list] | None = None
    restarts: int | None = None
    keep: bool | None = None
    memory: bool | None = None
    job: str | None = None

    @property
    def host(self) -> int:
        """The node rank of the job's host."""
        return self.nodes[0]

    @property
    def num_workers(self) -> int:
        return sum(self.slots)

    def name(self, node: int) -> str:
        """"node 2 (h2)" for a node of this round."""
        host = self.hosts[self.nodes.index(node)]
        return f"node {node} ({host})" if host else f"node {node}"

    def to_wire(self) -> dict[str, Any]:
        wire = dataclasses.asdict(self)
        for port in ("rendezvous_port", "scheduler_port", "addresses", "restarts", "keep",
                     "memory", "job"):
            if wire[port] is None:
                del wire[port]
        return wire

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> RoundSpec:
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in wire.items() if k in names}
        values.setdefault("reformation", 0)
        values.setdefault("elastic", False)
        values.setdefault("transport", "gloo")
        return cls(**values)


# ---------------------------------------------------------------------- node -> master
@dataclass(frozen=True)
class Hello(Message):
    """A node's launcher introduces itself (the host makes its own, never sent). An
    elastic node adds the ``addr`` the others reach it at and the ``port`` its
    launcher listens on, should it become the job's host."""

    TYPE: ClassVar[str] = "hello"
    node: int | None
    host: str | None
    nproc: int | None
    servers: int | None = None
    addr: str | None = _optional()
    port: int | None = _optional()

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> Hello:
        return cls(wire.get("node"), wire.get("host"), wire.get("nproc"), wire.get("servers"),
                   wire.get("addr"), wire.get("port"))


@dataclass(frozen=True)
class Status(Message):
    """A node's ranks (supervisor.py's rank states) and its ps-lite services; node 0
    stamps ``received`` with its own monotonic clock on arrival (never sent)."""

    TYPE: ClassVar[str] = "status"
    states: list[dict] = field(default_factory=list)
    service_failure: str | None = None
    services_ended: bool = False
    received: float | None = field(default=None, metadata={"local": True})
    # the ranks' step records since the last status, for the job's report (observe.py)
    steps: dict | None = _optional()


@dataclass(frozen=True)
class StacksFound(Message):
    TYPE: ClassVar[str] = "stacks"
    found: dict[int, str]


@dataclass(frozen=True)
class Stopped(Message):
    """The node's processes of the round have ended."""

    TYPE: ClassVar[str] = "stopped"


@dataclass(frozen=True)
class Idle(Message):
    """Between rounds: the node is alive."""

    TYPE: ClassVar[str] = "idle"


@dataclass(frozen=True)
class Preempt(Message):
    """The node's launcher got SIGTERM (elastic: a preemption notice)."""

    TYPE: ClassVar[str] = "preempt"


# ---------------------------------------------------------------------- master -> node
@dataclass(frozen=True)
class Start(Message):
    TYPE: ClassVar[str] = "start"
    spec: RoundSpec


@dataclass(frozen=True)
class Hint(Message):
    """The lowest collective count in the job (names the next key in reports)."""

    TYPE: ClassVar[str] = "hint"
    low: int


@dataclass(frozen=True)
class Verdicts(Message):
    """How ranks waiting at their exit end (jobcontrol.FINALIZE / ABANDON), by rank."""

    TYPE: ClassVar[str] = "verdicts"
    verdicts: dict[int, int]


@dataclass(frozen=True)
class StacksRequest(Message):
    TYPE: ClassVar[str] = "stacks"
    ranks: list[int]


@dataclass(frozen=True)
class Stop(Message):
    """Stop every worker at its next step boundary (request ``number``)."""

    TYPE: ClassVar[str] = "stop"
    number: int


@dataclass(frozen=True)
class News(Message):
    """Something the node's launcher should say (the job re-forms or restarts)."""

    TYPE: ClassVar[str] = "news"
    report: str


@dataclass(frozen=True)
class End(Message):
    """The round (``again``: and not the job) ends; the node exits with ``status``.
    ``terminated`` (default: status != 0) says whether to add that the node's processes
    were ended; ``grace`` is the seconds between their SIGTERM and SIGKILL; ``handover``:
    the host leaves (preempted), the node goes on under the next host; ``keep``: the
    workers that keep their processes stay for the next round (Node.end_round)."""

    TYPE: ClassVar[str] = "end"
    status: int
    again: bool
    report: str | None
    terminated: bool | None = _optional()
    grace: float | None = _optional()
    handover: bool | None = _optional()
    keep: bool | None = _optional()


@dataclass(frozen=True)
class Saved(Message):
    """Rank 0 saved the checkpoint of ``epoch`` and ``step``."""

    TYPE: ClassVar[str] = "saved"
    epoch: int
    step: int


@dataclass(frozen=True)
class Redirect(Message):
    """To a launcher that joined an elastic job through a node that does not host it:
    the job's host (``name``) is at ``addr``:``port``; the link then closes."""

    TYPE: ClassVar[str] = "redirect"
    addr: str
    port: int
    name: str


@dataclass(frozen=True)
class Welcome(Message):
    """The host took the node in, as a member of the next round or (``waiting``) to be
    admitted at the next re-formation: until then its join may still be dropped (the
    host was too busy to read its hello in time), and the node joins again. ``memory``:
    the job's workers keep their state in memory (dist_gluon.elastic.run), so it
    re-forms at their next commit, not at a checkpoint."""

    TYPE: ClassVar[str] = "welcome"
    waiting: bool = False
    memory: bool | None = _optional()


@dataclass(frozen=True)
class Tick(Message):
    """Node 0 is alive; ``clock``: its monotonic clock when it sent the tick, which
    bounds the offset of the two hosts' clocks (observe.py's _Clock)."""

    TYPE: ClassVar[str] = "tick"
    clock: float | None = _optional()


# ---------------------------------------------------------------------- reading
def from_node(wire: dict[str, Any]) -> Message | None:
    """A message that a node's launcher sent; None for a type node 0 does not know."""
    kind = wire.get("type")
    if kind == "status":
        return Status(wire.get("states", []), wire.get("service_failure"),
                      bool(wire.get("services_ended")), steps=wire.get("steps"))
    if kind == "stacks":
        return StacksFound({int(r): t for r, t in wire["found"].items()})
    if kind == "hello":
        return Hello.from_wire(wire)
    simple = {"stopped": Stopped, "idle": Idle, "preempt": Preempt}.get(kind)
    return simple() if simple else None


def from_master(wire: dict[str, Any]) -> Message | None:
    """A message that node 0's launcher sent; None for a type this node does not know."""
    kind = wire.get("type")
    if kind == "start":
        return Start(RoundSpec.from_wire(wire["spec"]))
    if kind == "hint":
        return Hint(wire["low"])
    if kind == "verdicts":
        return Verdicts({int(r): v for r, v in wire["verdicts"].items()})
    if kind == "stacks":
        return StacksRequest(list(wire["ranks"]))
    if kind == "stop":
        return Stop(wire["number"])
    if kind == "news":
        return News(wire["report"])
    if kind == "end":
        return End(wire["status"], wire.get("again", False), wire.get("report"),
                   wire.get("terminated"), wire.get("grace"), wire.get("handover"),
                   wire.get("keep"))
    if kind == "saved":
        return Saved(wire["epoch"], wire["step"])
    if kind == "redirect":
        return Redirect(wire["addr"], int(wire["port"]), wire["name"])
    if kind == "welcome":
        return Welcome(bool(wire.get("waiting")), wire.get("memory"))
    return Tick(wire.get("clock")) if kind == "tick" else None
