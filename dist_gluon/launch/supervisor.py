"""The job's judge: from every rank's progress record and process status it decides when
the job has failed, which rank caused it (the first to leave) and which failures are
consequences, when ranks that finished may run their collective shutdown, and when the
job stalls.

It sees the whole job as a list of rank states (plain dicts, the same whether a rank
runs on this node or on another node's launcher):

    rank, host, attached, count (collectives submitted), phase (jobcontrol.ATTACHED /
    DEPARTING), departed_at, exception ("Type: message"), returncode, ended_at, tail
    (last stderr lines), key_next (key of collective ``hint + 1``), key_last, left_at
    (when it left, on the judging launcher's monotonic clock)

Which rank left first is decided on one clock: each host reports how long ago its ranks
left by its own clock, and node 0 places that on its own. Wall-clock times written on
different hosts are never compared (a host whose clock is seconds off would otherwise be
blamed for a failure it only suffered).

A rank has *left* when its process ended or it reached interpreter exit. A rank that
left while another rank has submitted more collectives than it ever will is the cause of
a deadlock, even if it ended cleanly; a rank that failed (exception, non-zero status,
signal) ends the job at once. Errors other ranks hit after the first departure are
reported as consequences.
"""
from __future__ import annotations

import collections
import re
import time
from typing import NamedTuple

from .. import jobcontrol
from .processes import signal_name

SETTLE = 0.5            # seconds to let near-simultaneous departures land before judging
EXIT_WAIT = 3.0         # seconds a released rank gets to exit with its own status
SHUTDOWN_LIMIT = 30.0   # seconds ranks that finished may spend in the backend's shutdown
# Errors a rank hits because a peer went away; never the cause when another rank left.
_CONSEQUENCE = re.compile(
    r"has been shut down|shut ?down|ps-lite|ps::|Check failed|gloo|Gloo|connection|"
    r"Connection|Broken pipe|terminate called|peer|Peer", re.IGNORECASE)


def _left(s: dict) -> bool:
    return s["returncode"] is not None or s["phase"] == jobcontrol.DEPARTING \
        or s["exception"] is not None


def _failed(s: dict) -> bool:
    return s["exception"] is not None or (s["returncode"] not in (None, 0))


def _left_at(s: dict) -> float:
    # node 0's monotonic clock (see _JobView.states); never another host's wall clock
    left_at = s.get("left_at")
    return float("inf") if left_at is None else left_at


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _who(s: dict) -> str:
    return f"rank {s['rank']} ({s['host']})" if s.get("host") else f"rank {s['rank']}"


def describe_end(s: dict) -> str:
    """How a rank ended, e.g. 'exited (SystemExit: data directory missing)'."""
    code, tail = s["returncode"], [line for line in s.get("tail") or [] if line.strip()]
    if s["exception"]:
        return f"failed ({s['exception']})"
    if code is None:
        return "left its script (no uncaught exception) and was still shutting down"
    if s.get("killed_why"):
        return f"was killed by its launcher: {s['killed_why']}"
    if code < 0:
        return f"was killed by {signal_name(-code)}"
    if not s["attached"]:
        return f"exited with status {code}"
    if code == 0:
        return "finished its script (exit status 0)"
    if code == 1 and tail and not tail[-1].startswith((" ", "Traceback")):
        return f"exited (SystemExit: {tail[-1].strip()})"
    return f"exited (SystemExit: {code})"


def _shorten(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def exit_status(s: dict) -> int:
    code = s["returncode"]
    if code is None or code == 0:
        return 1
    return code if code > 0 else 128 - code


class Verdict(NamedTuple):
    """The supervisor's judgement of a job that is over: every worker ended cleanly
    (``ok``), or the job failed with exit ``status`` and ``report``."""

    ok: bool
    status: int = 0
    report: str | None = None


class Supervisor:
    """Judges a job from its rank states; see the module docstring."""

    def __init__(self, view, stall_warning: float | None, stall_timeout: float | None):
        self.view = view
        self.stall_warning, self.stall_timeout = stall_warning, stall_timeout
        self._failing_since: float | None = None
        self._released_at: float | None = None
        self._stall_state = None
        self._stall_since: float | None = None
        self._stall_warned = False
        self._finalized: set[int] = set()
        self._shutdown_since: float | None = None

    # ------------------------------------------------------------------ one look
    def check(self, states: list[dict], now: float | None = None) -> Verdict | None:
        """None while the job runs; a :class:`Verdict` once every worker ended cleanly
        or the job has failed."""
        now = time.monotonic() if now is None else now
        if not states:
            return None
        if self._failing_since is None and self._broken(states):
            self._failing_since = now
        if self._failing_since is not None:
            return self._judge(states, now)
        if all(_left(s) for s in states):
            self._release(states, jobcontrol.FINALIZE)
            if all(s["returncode"] == 0 for s in states):
                return Verdict(True)
            return self._watch_shutdown(states, now)
        return self._watch_stall(states, now)

    def _watch_shutdown(self, states, now) -> Verdict | None:
        """Every rank finished its script with every collective done; those still
        running are in the backend's collective shutdown (ps-lite's final barrier,
        horovod's shutdown). One that never returns (a peer's library lost the
        barrier's reply) would hang the job after its work is done: after
        SHUTDOWN_LIMIT the job ends as finished, saying so, and the launcher ends the
        stuck processes."""
        if self._shutdown_since is None:
            self._shutdown_since = now
        if now - self._shutdown_since < SHUTDOWN_LIMIT:
            return None
        stuck = [s for s in states if s["returncode"] is None]
        self.view.say(f"{_ranks(s['rank'] for s in stuck)} finished the script but "
                      f"{'is' if len(stuck) == 1 else 'are'} still in the backend's "
                      f"shutdown after {SHUTDOWN_LIMIT:g} s (every collective of every rank "
                      "had completed, so nothing is lost): ending "
                      f"{'it' if len(stuck) == 1 else 'them'}")
        return Verdict(True)

    def _broken(self, states) -> bool:
        if any(_failed(s) for s in states):
            return True
        return bool(self._deadlocked(states))

    @staticmethod
    def _deadlocked(states) -> list[dict]:
        """Ranks that left cleanly while another rank has submitted a collective they
        never will."""
        top = max(s["count"] for s in states)
        return [s for s in states if _left(s) and not _failed(s) and s["count"] < top]

    def _release(self, states, verdict) -> None:
        ready = {s["rank"]: verdict for s in states
                 if s["phase"] == jobcontrol.DEPARTING and s["returncode"] is None
                 and s["rank"] not in self._finalized}
        if ready:
            self._finalized.update(ready)
            self.view.set_verdicts(ready)

    # ------------------------------------------------------------------ failures
    def _judge(self, states, now):
        if now - self._failing_since < SETTLE:
            return None
        if self._released_at is None:
            # ranks blocked in their exit learn the job failed and end with their own
            # exit status, which the report then shows
            self._released_at = now
            self._release(states, jobcontrol.ABANDON)
        waiting = [s for s in states if _left(s) and s["returncode"] is None]
        if waiting and now - self._released_at < EXIT_WAIT:
            return None
        cause = self._cause(states)
        return Verdict(False, exit_status(cause), self._failure_report(cause, states))

    def _cause(self, states) -> dict:
        candidates = [s for s in states if _failed(s)] + self._deadlocked(states)
        candidates.sort(key=_left_at)
        first = candidates[0]
        if first["exception"] and _CONSEQUENCE.search(first["exception"]):
            others = [s for s in candidates[1:] if not (
                s["exception"] and _CONSEQUENCE.search(s["exception"]))]
            if others and _left_at(others[0]) - _left_at(first) < 5.0:
                return others[0]
        return first

    def _failure_report(self, cause, states) -> str:
        lines = [f"{_who(cause)} {describe_end(cause)} after {cause['count']} "
                 f"collective{'s' if cause['count'] != 1 else ''}" + self._waiters(cause, states)
                 + "."]
        ahead = [s for s in states if s["count"] > cause["count"]]
        if ahead and not _failed(cause):
            lines.append(
                f"tip: {_who(cause)} ran fewer collectives than {_ranks(s['rank'] for s in ahead)}."
                " Every rank must run the same number of steps (and of evaluations, "
                "barriers, checkpoints); give every rank the same number of batches: "
                "dist_gluon.ShardSampler pads or drops to equal shards (last_batch='pad' "
                "or 'drop'), and dist_gluon.shard_kwargs(kv) does it for mx.io iterators.")
        if not cause["attached"] and cause["count"] == 0 and any(s["count"] for s in states):
            lines.append(f"note: {_who(cause)} never created a dist_gluon backend "
                         "(dist_gluon.create()).")
        tail = cause.get("tail") or []
        if tail:
            lines.append(f"last lines of rank {cause['rank']}'s stderr:")
            lines.extend(f"    {line}" for line in tail)
        else:
            lines.append(f"rank {cause['rank']} wrote nothing to stderr.")
        after = [s for s in states if s is not cause and _failed(s)]
        if after:
            lines.append("consequences (failures after the first departure, not the cause):")
            lines.extend(f"    {_who(s)} {_shorten(describe_end(s))}" for s in after)
        return "\n".join(lines)

    @staticmethod
    def _waiters(cause, states) -> str:
        ahead = [s for s in states if s["count"] > cause["count"]]
        if not ahead:
            return ""
        n = cause["count"] + 1
        key = next((s["key_next"] for s in ahead if s.get("key_next")), None)
        verb = "waits" if len(ahead) == 1 else "wait"
        return (f"; {_ranks(s['rank'] for s in ahead)} {verb} in collective #{n}"
                + (f" (key {key!r})" if key else ""))

    # ------------------------------------------------------------------ stalls
    def _watch_stall(self, states, now):
        """A stall is a job whose collective counts have not moved for
        ``--stall-warning`` seconds while its ranks are in different collectives:
        either some ranks wait in a collective the lowest have not reached, or every
        rank submitted as many but the last ones differ (a rank in a sum of its own
        while the others block in the step's: a sync check after a re-formation, a
        user's extra sum). The second kind had been silent: only a lower count was
        looked for. Per round: the supervisor and the records start with the round."""
        if self.stall_warning is None and self.stall_timeout is None:
            return None
        # a kept worker that has not entered the round yet still shows the round
        # before's collectives: the others wait for it at the rendezvous, and its
        # launcher kills it if it never enters (node.py ENTER_LIMIT)
        stall = None if any(s.get("entering") for s in states) else _stall(states)
        if stall != self._stall_state:
            self._stall_state, self._stall_since, self._stall_warned = stall, now, False
        if stall is None:
            return None
        waited = now - self._stall_since
        if self.stall_timeout is not None and waited >= self.stall_timeout \
                and stall[0] != _QUIET:
            report = self._stall_report(states, stall, waited)
            return Verdict(False, 124, report + f"\nstall timeout ({self.stall_timeout:g} s).")
        if self.stall_warning is not None and waited >= self.stall_warning \
                and not self._stall_warned:
            self._stall_warned = True
            self.view.say(self._stall_report(states, stall, waited)
                          + "\nThe job keeps running (--stall-timeout SEC ends it).")
        return None

    def _stall_report(self, states, stall, waited) -> str:
        kind, low, lagging = stall
        by_rank = {s["rank"]: s for s in states}
        shown = sorted(lagging)
        if kind == _QUIET:
            # every rank is alike: the lowest ones' stacks stand for all
            shown = shown[:_QUIET_STACKS]
            key = by_rank[min(lagging)]["key_last"]
            lines = [f"stall: no rank has submitted a collective for {waited:.0f} s; every "
                     f"rank's last was #{low} (key {key!r}). Either they all compute (a "
                     "long evaluation or step without collectives), or they all wait for "
                     "that collective and their transport does not complete it (ps-lite's "
                     "servers and scheduler must answer; over horovod, its background "
                     "threads)."]
        elif kind == _APART:
            running = [s for s in states if s["rank"] in lagging]
            where = "; ".join(f"rank {s['rank']} ({s['host'] or '?'}) in "
                              + _keys(_unmatched(s, running)) for s in running)
            lines = [f"stall: {_ranks(lagging)} have each submitted {low} collectives and "
                     f"none has submitted another for {waited:.0f} s, but the last ones "
                     f"differ (collective #{low}): {where}. The ranks called different "
                     "collectives; each waits for the others to join its own."]
        else:
            hosts = ", ".join(by_rank[r]["host"] or "?" for r in shown)
            ahead = [s for s in states if s["count"] > low]
            n = low + 1
            key = next((s["key_next"] for s in ahead if s.get("key_next")), None)
            lines = [f"stall: {_ranks(s['rank'] for s in ahead)} "
                     f"{'has' if len(ahead) == 1 else 'have'} waited {waited:.0f} s in "
                     f"collective #{n}" + (f" (key {key!r})" if key else "")
                     + f" that {_ranks(lagging)} ({hosts}) "
                     f"{'has' if len(lagging) == 1 else 'have'} not reached"
                     + (f" (last submitted: #{low}, key {by_rank[min(lagging)]['key_last']!r})"
                        if low else " (no collective submitted yet)") + "."]
        # a process that does not run cannot answer for its stacks: say so first
        lines.extend(self.view.process_report())
        stacks = self.view.stacks(shown)
        for rank in shown:
            text = stacks.get(rank)
            if text:
                lines.append(f"Python stacks of rank {rank} (every thread):")
                lines.extend(f"    {line}" for line in text.rstrip().splitlines())
            else:
                lines.append(f"no Python stacks from rank {rank} (it has not imported "
                             "dist_gluon's backend, or did not answer)")
        return "\n".join(lines)


_BEHIND, _APART, _QUIET = "behind", "apart", "quiet"
# the ranks whose Python stacks a quiet job's report shows (the lowest)
_QUIET_STACKS = 2


def _unmatched(state, running) -> list[str]:
    """The keys of ``state``'s rank that another running rank has not submitted, newest
    first: among the last keys each reported (``keys_recent``, the same span of
    collective numbers, since their counts are equal), those left when the keys common
    to all are taken out. MXNet's engine can submit a step's collectives out of the
    script's order (a SyncBatchNorm backward after the next forward), so the last key
    alone may be one the others have too. Without every rank's keys: the last key."""
    windows = [s.get("keys_recent") for s in running]
    if any(not w for w in windows):
        return [state["key_last"]]
    common = collections.Counter(windows[0])
    for window in windows[1:]:
        common &= collections.Counter(window)
    left = collections.Counter(state["keys_recent"]) - common
    found = []
    for key in reversed(state["keys_recent"]):
        if left[key] > 0:
            left[key] -= 1
            found.append(key)
    return found or [state["key_last"]]


def _keys(keys) -> str:
    """``key 'a'``, or ``keys 'a', 'b'`` (at most 3 named)."""
    if len(keys) == 1:
        return f"key {keys[0]!r}"
    named = ", ".join(repr(k) for k in keys[:3])
    return f"keys {named}" + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")


def _stall(states) -> tuple[str, int, frozenset] | None:
    """Whether the ranks are in different collectives, as (kind, count, ranks):
    ``_BEHIND``, some ranks are ahead of the lowest count and ``ranks`` (the lowest,
    still running) have not reached their collective; ``_APART``, every running rank
    has submitted ``count`` collectives but the keys of the last differ (``ranks``:
    all of them). None when the ranks agree (they may be computing)."""
    low = min(s["count"] for s in states)
    running = [s for s in states if not _left(s)]
    lagging = frozenset(s["rank"] for s in running if s["count"] == low)
    if any(s["count"] > low for s in states):
        return (_BEHIND, low, lagging) if lagging else None
    keys = {s.get("key_last") for s in running}
    if low and len(running) > 1 and len(keys) > 1 and None not in keys:
        return _APART, low, frozenset(s["rank"] for s in running)
    if low and running:
        # the ranks agree: they compute, or all wait in collective #low, which their
        # transport does not complete (a stopped ps-lite server, a stuck link); only
        # its length tells (_watch_stall), and it is reported, never ended
        return _QUIET, low, frozenset(s["rank"] for s in running)
    return None
