"""The per-rank report: where each rank's step time goes, which rank the others wait
for (the straggler) and why, and what bounds the job. Pure functions of the workers'
step records (dist_gluon/timeline.py's ``STEP``), so tests give them numbers.

A step of rank r, from one ``trainer.step()`` return to the next (its period), is
split into four shares, as far as they are visible from outside MXNet's engine:

- **data**: the training thread waited for the next batch (``dist_gluon.timeline.data``);
- **waiting for others**: r was ready (its Python had called ``step()`` and its
  backward had ended on the engine) before the last rank of the job was; the time
  until that rank was ready;
- **communication**: from the moment every rank was ready until r's last gradient sum
  arrived;
- **compute**: the rest (forward, backward, the optimizer update, the script's own
  work).

Ranks of a synchronous job step together, so their periods are alike; what differs is
the *busy* time (period minus waiting for others). The straggler is the rank whose
median busy time is at least :data:`STRAGGLER_RATIO` times the others'.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field

STRAGGLER_RATIO = 1.25
# the host's CPU counts as the bound when its ranks use this share of its cores
CPU_BUSY = 0.85
SHARES = ("data", "compute", "comm", "wait")
_SHARE_NAMES = {"data": "waiting for data", "compute": "compute",
                "comm": "communication", "wait": "waiting for other ranks"}


@dataclass
class RankReport:
    rank: int
    host: str
    steps: int                  # the steps it made (the shares cover the latest ones)
    median: float               # seconds per step
    p90: float
    busy: float                 # median seconds per step not spent waiting for others
    shares: dict[str, float]    # of the step time, by SHARES
    cpu: float                  # the rank's CPU seconds per second
    samples_per_s: float
    bytes_per_step: float


@dataclass
class Report:
    ranks: list[RankReport] = field(default_factory=list)
    straggler: dict | None = None
    bound: dict | None = None
    steps_per_s: float = 0.0
    samples_per_s: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)


def _finite(x: float) -> bool:
    return x == x and not math.isinf(x)


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def breakdown(records: dict[int, list[tuple]],
              asynchronous: bool = False) -> dict[int, list[tuple]]:
    """Each rank's steps split into the four shares: rank -> list of ``(step, end,
    period, data, compute, comm, wait)`` in seconds (``end`` on the records' clock),
    for every step whose previous step the rank also recorded. ``asynchronous``
    (dist_async): ranks never wait for one another, and their steps of the same
    number are unrelated; communication runs from this rank's readiness. A step with
    no sum (Local SGD, DiLoCo between two averagings) waits for no one either."""
    ready_by_step: dict[int, float] = {}
    for rows in records.values():
        for row in rows:
            index, start, _header, _end, ready, sums = row[:6]
            if not _finite(sums):
                continue        # a step without a sum (Local SGD's) waits for no one
            mine = max(start, ready) if _finite(ready) else start
            ready_by_step[index] = max(ready_by_step.get(index, -math.inf), mine)
    split = {}
    for rank, rows in records.items():
        previous = {row[0]: row for row in rows}
        steps = []
        for row in rows:
            index, start, _header, end, ready, sums, data = row[:7]
            before = previous.get(index - 1)
            period = end - before[3] if before is not None else 0.0
            if period <= 0:
                continue
            mine = max(start, ready) if _finite(ready) else start
            # ranks wait for one another only in a step that sums: Local SGD's and
            # DiLoCo's steps between two averagings are each rank's own
            last = mine if asynchronous or not _finite(sums) \
                else ready_by_step.get(index, mine)
            wait = min(period, max(0.0, last - mine))
            comm = min(period - wait, max(0.0, sums - last)) if _finite(sums) else 0.0
            data = min(period - wait - comm, max(0.0, data))
            steps.append((index, end, period, data, period - wait - comm - data, comm,
                          wait))
        split[rank] = steps
    return split


def build(records: dict[int, list[tuple]], hosts: dict[int, str],
          cores: dict[str, int] | None = None, asynchronous: bool = False) -> Report:
    """The report of one round from each rank's step records (rank -> records in step
    order), ``hosts`` (rank -> host name) and ``cores`` (host -> CPU count);
    ``asynchronous``: a dist_async job (see :func:`breakdown`)."""
    split = breakdown(records, asynchronous)
    ranks = []
    for rank in sorted(records):
        rows = records[rank]
        # the first step of a round carries start-up work (deferred initialisation, the
        # first kernels): left out once there are more
        steps = [s for s in split[rank] if s[0] > rows[0][0] + 1] or split[rank]
        if not steps:
            continue
        periods = [s[2] for s in steps]
        elapsed = sum(periods)
        totals = {k: sum(s[3 + i] for s in steps) for i, k in enumerate(SHARES)}
        used = [row for row in rows if steps[0][0] - 1 <= row[0] <= steps[-1][0]]
        span = used[-1][3] - used[0][3]
        cpu = (used[-1][7] - used[0][7]) / span if span > 0 else 0.0
        counted = used[1:]
        ranks.append(RankReport(
            rank=rank, host=hosts.get(rank, "?"), steps=rows[-1][0],
            median=statistics.median(periods), p90=_p(periods, 0.9),
            busy=statistics.median(s[2] - s[6] for s in steps),
            shares={k: v / elapsed for k, v in totals.items()},
            cpu=max(0.0, cpu), samples_per_s=sum(row[8] for row in counted) / elapsed,
            bytes_per_step=sum(row[9] for row in counted) / max(1, len(counted))))
    report = Report(ranks=ranks)
    if ranks:
        report.steps_per_s = 1.0 / statistics.median(r.median for r in ranks)
        report.samples_per_s = sum(r.samples_per_s for r in ranks)
    report.straggler = _straggler(ranks)
    report.bound = _bound(ranks, report.straggler, cores or {})
    return report


def _busy_shares(rank: RankReport) -> dict[str, float]:
    """Shares of the rank's busy time (its step without waiting for others)."""
    busy = 1.0 - rank.shares["wait"]
    return {k: (rank.shares[k] / busy if busy > 0 else 0.0) for k in ("data", "compute",
                                                                       "comm")}


def _straggler(ranks: list[RankReport]) -> dict | None:
    if len(ranks) < 2:
        return None
    slowest = max(ranks, key=lambda r: r.busy)
    others = statistics.median(r.busy for r in ranks if r is not slowest)
    # the others may wait for nearly all of their step (tiny models): their busy time
    # then rounds to nothing, and the ratio is large rather than undefined
    floor = 0.01 * slowest.median
    if slowest.busy <= floor or slowest.busy < STRAGGLER_RATIO * max(others, floor):
        return None
    ratio = slowest.busy / max(others, floor)
    shares = _busy_shares(slowest)
    why = max(shares, key=shares.get)
    return {"rank": slowest.rank, "host": slowest.host,
            "ratio": ratio, "busy": slowest.busy, "others_busy": others,
            "why": why, "why_share": shares[why],
            "text": (f"rank {slowest.rank} on {slowest.host}: busy {ratio:.1f}x "
                     f"the others' ({_ms(slowest.busy)} vs {_ms(others)} a step), "
                     f"{100 * shares[why]:.0f}% of it {_SHARE_NAMES[why]}")}


def _bound(ranks: list[RankReport], straggler: dict | None,
           cores: dict[str, int]) -> dict | None:
    if not ranks:
        return None
    if straggler is not None:
        what = {"data": "input", "compute": "compute", "comm": "link"}[straggler["why"]]
        return {"kind": what, "text": f"{what}, on the straggler (rank "
                                      f"{straggler['rank']}): the others wait for it"}
    mean = {k: statistics.fmean(r.shares[k] for r in ranks) for k in SHARES}
    top = max(("data", "compute", "comm"), key=mean.get)
    if top == "data":
        return {"kind": "input", "text": f"input: {100 * mean['data']:.0f}% of a step "
                                         "waits for data"}
    if top == "comm":
        per_step = statistics.fmean(r.bytes_per_step for r in ranks)
        seconds = statistics.fmean(r.shares["comm"] * r.median for r in ranks)
        rate = per_step / seconds if seconds > 0 else 0.0
        return {"kind": "link", "bytes_per_step": per_step, "rate": rate,
                "text": f"link: {100 * mean['comm']:.0f}% of a step communicates, "
                        f"{_mb(per_step)} of gradients a step in {_ms(seconds)} "
                        f"({_mb(rate)}/s achieved per rank)"}
    by_host: dict[str, float] = {}
    for r in ranks:
        by_host[r.host] = by_host.get(r.host, 0.0) + r.cpu
    for host, used in sorted(by_host.items(), key=lambda kv: -kv[1]):
        count = cores.get(host)
        if count and used >= CPU_BUSY * count:
            return {"kind": "cpu", "host": host, "cores_used": used, "cores": count,
                    "text": f"CPU: the ranks on {host} keep {used:.1f} of its {count} "
                            "cores busy"}
    return {"kind": "compute", "text": f"compute: {100 * mean['compute']:.0f}% of a step"}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.1f} s"


def _mb(count: float) -> str:
    return f"{count / 1e6:.1f} MB" if count >= 1e5 else f"{count / 1e3:.1f} kB"


def table(report: Report, title: str = "report") -> str:
    """The report as the launcher prints it."""
    if not report.ranks:
        return f"{title}: no training steps seen (no trainer stepped)"
    lines = [f"{title}: {report.steps_per_s:.2f} steps/s, "
             f"{report.samples_per_s:.0f} samples/s",
             f"{'rank':>4} {'host':<12} {'steps':>6} {'median':>9} {'p90':>9} "
             f"{'data':>5} {'compute':>7} {'comm':>5} {'wait':>5} {'cpu':>5}"]
    for r in report.ranks:
        s = r.shares
        lines.append(f"{r.rank:>4} {r.host[:12]:<12} {r.steps:>6} {_ms(r.median):>9} "
                     f"{_ms(r.p90):>9} {100 * s['data']:>4.0f}% {100 * s['compute']:>6.0f}% "
                     f"{100 * s['comm']:>4.0f}% {100 * s['wait']:>4.0f}% {r.cpu:>5.2f}")
    lines.append("straggler: " + (report.straggler["text"] if report.straggler
                                  else "none (no rank is busy "
                                       f"{STRAGGLER_RATIO:g}x the others' time)"))
    if report.bound:
        lines.append("bound: " + report.bound["text"])
    return "\n".join(lines)
