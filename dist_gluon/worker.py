"""Where this worker is in its job: :class:`WorkerContext`, read once from the
environment the launcher (``dist_gluon.launch``) gives it.

The launcher places each worker with ``DG_*`` variables: its rank and the world's size,
its node, how many times the job was restarted or re-formed, whether the job is elastic,
and the job's directories. They are parsed here once, into one typed object that the
modules needing them read (the trainer's sync check, the timeline, dist_gluon.elastic,
checkpoints, devices), instead of each module reading the environment on its own: at
an in-process re-formation (:func:`dist_gluon.elastic.run` on horovod) the worker is
handed its next round, and :meth:`WorkerContext.update` changes the one object in place,
so no module keeps a stale rank.

Without a launcher every field has its one-process value (rank 0 of 1, no restart, not
elastic, no directories). Only ``dist_gluon/backends/`` reads the transports' own
variables (``DMLC_*``, ``HOROVOD_*``). Standard library only: ``jobcontrol`` (which the
launcher imports too) may use it.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

# the launcher's variables, by field (dist_gluon/launch/node.py sets them)
_VARIABLES = {
    "rank": "DG_RANK", "num_workers": "DG_NUM_WORKERS", "local_rank": "DG_LOCAL_RANK",
    "node_rank": "DG_NODE_RANK", "nnodes": "DG_NNODES", "restart": "DG_RESTART",
    "reformation": "DG_REFORMATION", "elastic": "DG_ELASTIC", "heal": "DG_ELASTIC_HEAL",
    "backend": "DG_BACKEND", "job_id": "DG_JOB_ID", "state_dir": "DG_STATE_DIR",
    "control_dir": "DG_CONTROL_DIR", "observe_dir": "DG_OBSERVE_DIR",
    "observe": "DG_OBSERVE", "tune": "DG_TUNE",
}
_AT_LEAST_ONE = ("num_workers", "nnodes")


@dataclass
class WorkerContext:
    """This worker's place in the job, as the launcher set it.

    Parameters
    ----------
    rank, num_workers, local_rank : int
        The worker's rank among ``num_workers`` (``DG_RANK``, ``DG_NUM_WORKERS``), and on
        its node (``DG_LOCAL_RANK``).
    node_rank, nnodes : int
        Its node among the job's nodes that run workers (``DG_NODE_RANK``, ``DG_NNODES``).
    restart : int
        The job's round: how many times the launcher restarted or re-formed it
        (``DG_RESTART``).
    reformation : int
        How many times an elastic job's set of nodes changed (``DG_REFORMATION``).
    elastic : bool
        An elastic job (``--nnodes MIN:MAX``, ``DG_ELASTIC=1``): the launcher may ask the
        ranks to stop or to re-form.
    heal : bool
        The worker gets its state from live peers or the node's copy in memory, not
        from a new job's broadcast of the model (``DG_ELASTIC_HEAL=1``).
    backend : str or None
        The launcher's ``--backend`` (``DG_BACKEND``).
    job_id : str
        The elastic job's id (``DG_JOB_ID``; empty elsewhere).
    state_dir, control_dir, observe_dir : str or None
        The job's directories: the node's copy of the state in shared memory
        (``DG_STATE_DIR``), the job-control records (``DG_CONTROL_DIR``), the step
        records and trace (``DG_OBSERVE_DIR``).
    observe : str or None
        What the timeline records: ``'steps'`` or ``'timeline'`` (``DG_OBSERVE``).
    tune : bool
        Whether horovod's cycle time is tuned on the job's first steps (``DG_TUNE``,
        default on; the launcher's ``--no-tune`` sets 0).
    placed : bool
        The launcher placed this process as a worker (``DG_RANK`` is set; its
        scheduler and servers have none).
    """

    rank: int = 0
    num_workers: int = 1
    local_rank: int = 0
    node_rank: int = 0
    nnodes: int = 1
    restart: int = 0
    reformation: int = 0
    elastic: bool = False
    heal: bool = False
    backend: str | None = None
    job_id: str = ""
    state_dir: str | None = None
    control_dir: str | None = None
    observe_dir: str | None = None
    observe: str | None = None
    tune: bool = True
    placed: bool = False

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> WorkerContext:
        """The context ``environ`` (default ``os.environ``) describes. ValueError naming
        the variable for a count that is not an int >= 0."""
        context = cls()
        context.update(os.environ if environ is None else environ)
        return context

    def update(self, environ: Mapping[str, str]) -> None:
        """Take the launcher's variables present in ``environ`` (a round's environment,
        handed at an in-process re-formation), in place: fields whose variable is absent
        keep their value."""
        parsed = {}
        if _VARIABLES["rank"] in environ:
            parsed["placed"] = True
        for field in fields(self):
            name = _VARIABLES.get(field.name)
            if name is None or name not in environ:
                continue
            text = environ[name].strip()
            if field.type == "int":
                parsed[field.name] = _count(name, text, 1 if field.name in _AT_LEAST_ONE else 0)
            elif field.type == "bool":
                parsed[field.name] = text == "1"
            elif field.name == "job_id":
                parsed[field.name] = text
            else:
                parsed[field.name] = text or None
        for name, value in parsed.items():
            setattr(self, name, value)


def _count(name: str, text: str, low: int) -> int:
    try:
        value = int(text) if text else low
    except ValueError:
        value = -1
    if value < low:
        raise ValueError(f"{name}={text!r} must be an int >= {low} (the launcher sets it; "
                         f"unset it when you start workers yourself)")
    return value


_context: WorkerContext | None = None


def context() -> WorkerContext:
    """This process's :class:`WorkerContext`, parsed from the environment at the first
    call; the same object afterwards (updated in place at a re-formation)."""
    global _context
    if _context is None:
        _context = WorkerContext.from_environ()
    return _context
