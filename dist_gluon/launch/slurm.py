"""Defaults for a launcher started by SLURM's ``srun`` (one launcher per node)."""
from __future__ import annotations

import re

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list as host names, in order.

    Examples
    --------
    >>> expand_nodelist("node[01-03,07],gpu5")
    ['node01', 'node02', 'node03', 'node07', 'gpu5']
    """
    hosts, item, depth = [], "", 0
    for char in nodelist + ",":
        if char == "," and depth == 0:
            if item:
                hosts.extend(_expand_item(item))
            item = ""
            continue
        depth += char == "["
        depth -= char == "]"
        if depth < 0:
            raise ValueError(f"unbalanced ']' in SLURM node list {nodelist!r}")
        item += char
    if depth:
        raise ValueError(f"unbalanced '[' in SLURM node list {nodelist!r}")
    return hosts


def _expand_item(item: str) -> list[str]:
    start = item.find("[")
    if start < 0:
        return [item]
    end = item.index("]", start)
    prefix, ranges, rest = item[:start], item[start + 1:end], item[end + 1:]
    names = []
    for part in ranges.split(","):
        match = _RANGE.match(part.strip())
        if not match:
            raise ValueError(f"cannot read the range {part!r} in SLURM node list item "
                             f"{item!r}")
        first, last = match.group(1), match.group(2) or match.group(1)
        width = len(first)
        for number in range(int(first), int(last) + 1):
            names.append(f"{prefix}{number:0{width}d}")
    return [name + tail for name in names for tail in _expand_item(rest)] if rest \
        else names


def defaults(environ) -> dict | None:
    """nnodes, node_rank and master_addr from SLURM's variables, or None outside srun
    or when srun started more than one launcher per node (then each would start the
    node's workers again)."""
    if "SLURM_JOB_ID" not in environ or "SLURM_NODEID" not in environ:
        return None
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
    nnodes = environ.get("SLURM_STEP_NUM_NODES") or environ.get("SLURM_NNODES")
    if not nodelist or not nnodes:
        return None
    tasks = environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_NTASKS")
    if tasks is not None and int(tasks) != int(nnodes):
        raise ValueError(
            f"srun started {tasks} tasks on {nnodes} nodes: run one launcher per node "
            "(srun --ntasks-per-node=1 dist-gluon-run -n N ...), it starts the N workers")
    hosts = expand_nodelist(nodelist)
    return {"nnodes": int(nnodes), "node_rank": int(environ["SLURM_NODEID"]),
            "master_addr": hosts[0]}
