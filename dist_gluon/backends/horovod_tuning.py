"""Horovod's cycle time, tuned on the job's own first steps.

horovod reads ``HOROVOD_CYCLE_TIME`` (how often its background thread negotiates what is
ready; default 1 ms) once, at ``hvd.init()``. No fixed cycle suits every job
(benchmarks/FINDINGS.md 9c, 9d, 9i): every cycle costs CPU, which a waiting rank burns
and a step bound by the CPU of shared cores feels (VGG-16 on 1 Gbit/s), while a longer
cycle delays every sum by up to a cycle, which a step of milliseconds feels (the MNIST
example) and so do SyncBatchNorm's chained per-layer sums.

Over Gloo, under dist_gluon's launcher, the backend can leave horovod and join it again
in the same process (``hvd.shutdown()``, new variables, ``hvd.init()``: about 0.13 s; the
launcher's rendezvous store is empty again once every rank has joined). So
:class:`Tuner` times the job's own steps (those of
:class:`~dist_gluon.DistributedTrainer` and of the peers' trainers in
``dist_gluon.compat``) under each cycle of :data:`CYCLES_MS`, shortest first (horovod's
default), and keeps one for the rest of the run:

1. The first :data:`WARMUP_STEPS` steps are left alone (graph building, allocation);
   rank 0 times the last of them and sets how many steps each cycle is timed over, so
   that each takes about :data:`SECONDS_PER_CANDIDATE` (at least :data:`MIN_STEPS`, at
   most :data:`MAX_STEPS`); every rank follows rank 0's plan. Where several trainers
   take turns (a GAN's two), the warm-up lasts until one steps again, and the steps
   timed, and those left out before each timing, are whole rounds of them: every
   window holds each trainer as often, and none of their first steps after horovod
   starts again, which negotiate their tensors afresh (horovod's response cache is
   empty; benchmarks/FINDINGS.md 11e).
2. The default cycle (horovod as it started) is timed first. If its step is shorter
   than :data:`SHORT_STEP_CYCLES` longest cycles, it is kept (a longer cycle cannot pay
   there). Else horovod starts again with the next cycle and that is timed, and so on
   while the cycle just timed is the choice so far (below): a longer cycle that was
   slower ends the climb. A timing leaves one step (one round) out, waits for the
   engine, runs the steps and waits for the engine again: ``trainer.step`` returns
   while the sums run, so only a window closed by waits holds its steps' whole work.
   Rank 0's time per step decides.
3. The choice is the longest cycle timed whose step is within :data:`TOLERANCE` of the
   fastest: as fast, and a waiting rank burns less CPU with it. If horovod runs with
   another one at the end of the climb, it starts once more with the choice.
4. Rank 0 prints one line: what was chosen and why, with every time.
5. Collectives chained within a step (SyncBatchNorm's sums through the backend, two per
   layer, each waiting for the one before: :meth:`Tuner.chained`) wait up to a cycle
   each, so a longer cycle cannot pay there, whatever steps it was timed on (a job's
   first steps may be others': a model without the layer, or ``make bench``'s three
   models taking turns). From the step in which they first run, the default cycle is
   kept, and horovod starts again with it if it runs with another.

Why the cycle only, and the fusion threshold left alone: horovod 0.28.1's
ParameterManager keeps a variable fixed by the environment for the life of the process
and, at each later ``hvd.init()``, writes the built-in defaults of the fixed ones into
the slots of the others; once both the cycle time and the fusion threshold are fixed,
the next ``hvd.init()`` crashes (a segmentation fault: benchmarks/FINDINGS.md 9i). So
the fusion threshold is never set here; the cycle alone survives every restart (four
at most here: two up the climb, one back, one for chained sums after it; measured: up
to seven in a row, FINDINGS.md 9k). By
horovod's code, the first restart leaves horovod's fusion threshold at 1 MiB instead of
128 MiB (its cycle default written into the threshold's slot); no difference was
measurable (FINDINGS.md 9i).

For the same reason nothing is tuned in an elastic job (``--nnodes MIN:MAX``, or
``--max-restarts`` on one machine), whose in-process re-formation starts horovod again,
nor when the user set ``HOROVOD_CYCLE_TIME`` or ``HOROVOD_FUSION_THRESHOLD`` (their
values win) or turned horovod's own autotuner on (``HOROVOD_AUTOTUNE=1``, which fixes
both variables in the process as it goes), nor over MPI or under horovodrun (horovod
starts once per process there).
``DG_TUNE=0`` (the launcher's ``--no-tune``) turns tuning off.
"""
from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

CYCLE_ENV = "HOROVOD_CYCLE_TIME"
FUSION_ENV = "HOROVOD_FUSION_THRESHOLD"
AUTOTUNE_ENV = "HOROVOD_AUTOTUNE"
DEFAULT_CYCLE_MS = 1.0                # horovod 0.28.1's
# the cycles timed, shortest first: 5 ms is the best of the three for steps of many
# chained small sums beside the gradients' (SyncBatchNorm over its side channel), 20 ms
# for steps bound by the link or by shared cores (VGG-16 with a codec at 1 Gbit/s)
# (benchmarks/FINDINGS.md 9i, 11d, 9k)
CYCLES_MS = (DEFAULT_CYCLE_MS, 5.0, 20.0)
LONG_CYCLE_MS = CYCLES_MS[-1]
WARMUP_STEPS = 2
SECONDS_PER_CANDIDATE = 0.5
MIN_STEPS, MAX_STEPS = 2, 12
# trainers taking turns beyond this many are timed as one (a script that makes a new
# trainer every step)
MAX_ROUND = 4
TOLERANCE = 0.02
# A step this many longest cycles long or shorter cannot gain from a longer cycle: it
# waits about half a cycle more per negotiation (up to 10 ms), at least 10% of it, while
# horovod's 1-ms negotiation takes 0.07-0.12 s of CPU per second (FINDINGS.md 9c, 9i),
# so no other cycle is tried (no restart either): the MNIST example's 25-ms steps
SHORT_STEP_CYCLES = 5


def _autotuning(environ) -> bool:
    """horovod's own autotuner is on (it reads HOROVOD_AUTOTUNE as an integer > 0)."""
    try:
        return int(environ.get(AUTOTUNE_ENV, "0").strip() or "0") > 0
    except ValueError:
        return False


class Tuner:
    """Tunes one horovod backend's cycle time on its first steps.

    Parameters
    ----------
    restart : callable
        ``restart(settings)`` leaves horovod and joins it again with ``settings``
        (variable -> text) in the environment; every rank calls it at the end of the
        same step, with nothing in flight.
    wait : callable
        Waits until the engine has done everything pushed so far (``mx.nd.waitall``).
    broadcast : callable
        ``broadcast(obj)`` returns rank 0's ``obj`` on every rank (a collective).
    rank : int
        This process's rank.
    enabled : bool
        False: nothing is tuned, silently (``DG_TUNE=0``, the launcher's ``--no-tune``,
        or a job of one worker).
    reason_not : str or None
        Why nothing can be tuned in this process (rank 0 prints it at the first step's
        end), or None.
    environ : mapping
        The environment that holds the user's own values, read here, once.
    """

    def __init__(self, restart: Callable[[dict[str, str]], None], wait: Callable[[], None],
                 broadcast: Callable[[object], object], rank: int,
                 enabled: bool = True, reason_not: str | None = None, environ=os.environ):
        # settings
        self._restart, self._wait = restart, wait
        self._broadcast, self._rank = broadcast, rank
        user = {name: environ[name] for name in (CYCLE_ENV, FUSION_ENV) if name in environ}
        if _autotuning(environ) and reason_not is None:
            # horovod's autotuner changes both in the process, which a restart of ours
            # would not survive (see above)
            reason_not = f"horovod's own autotuner is on ({AUTOTUNE_ENV}); it chooses"
        if user and reason_not is None:
            reason_not = " and ".join(f"{name}={value}" for name, value in user.items()) \
                + " set by the user " + ("win" if len(user) > 1 else "wins")
        self._enabled, self.reason_not = enabled, reason_not
        # internal state
        self._steps = 0                 # steps ended so far
        self._per_candidate = 0         # steps timed per cycle (rank 0's plan)
        self._owners: list = []         # the trainers seen in the warm-up, in turn
        self._round = 1                 # how many take turns (rank 0's plan)
        self._current: float | None = None   # the cycle being timed
        self._skip = 0                  # steps left out before its timing starts
        self._timed = 0                 # its steps timed so far
        self._started: float | None = None   # when its timing started
        self._last_end: float | None = None
        # results
        self.step_times: dict[float, float] = {}   # cycle (ms) -> s per step, rank 0's
        self.settings: dict[str, str] = {}      # what horovod runs with, once chosen
        self.steps: tuple[int, int] = (0, 0)    # the first and last step of the tuning
        self.done = False
        self._chained: str | None = None    # why the default cycle must be kept
        self._chained_seen = False

    def chained(self, why: str) -> None:
        """Collectives that wait for each other within every step run from this step on
        (the same step on every rank): ``why`` names them. At this step's end the default
        cycle is kept for the rest of the run (see the module's docstring)."""
        if self._chained is None:
            self._chained = why

    def step_ended(self, owner: object = None) -> None:
        """Called by the trainer at the end of every step, on every rank; ``owner`` is
        the trainer (the job's trainers take turns in rounds: see :meth:`_warm_up`)."""
        self._steps += 1
        if self._chained is not None and not self._chained_seen:
            self._keep_default()
            return
        if self.done:
            return
        if not self._enabled or self.reason_not is not None:
            self._give_up()
            return
        if self._current is None:
            now = time.monotonic()
            if self._warm_up(owner):
                self._plan(now)
            self._last_end = now
            return
        if self._skip:
            self._skip -= 1
            if not self._skip:
                self._wait()
                self._started = time.monotonic()
            return
        self._timed += 1
        if self._timed >= self._per_candidate:
            self._wait()
            self.step_times[self._current] = \
                (time.monotonic() - self._started) / self._timed
            self._next()

    def _warm_up(self, owner: object) -> bool:
        """Count a warm-up step of ``owner``; True when the warm-up ends here: at
        :data:`WARMUP_STEPS` steps, and not before a trainer steps again, so that it has
        seen the round of trainers that take turns (a GAN's two, make bench's three;
        one in most jobs). The same step on every rank (the same script)."""
        repeated = owner in self._owners
        if not repeated:
            self._owners.append(owner)
        if len(self._owners) > MAX_ROUND:
            self._owners = [None]       # no round: one step at a time
            repeated = True
        return self._steps >= WARMUP_STEPS and repeated

    def _plan(self, now: float) -> None:
        """Rank 0's last warm-up step sets the number of steps per cycle for all: whole
        rounds of the trainers that take turns, so that every window holds each as often,
        and each window starts after a round (after horovod starts again, a trainer's
        first step negotiates its tensors afresh: horovod's response cache is empty)."""
        period = now - self._last_end if self._last_end is not None else 0.0
        steps = MAX_STEPS if period <= 0 else int(SECONDS_PER_CANDIDATE / period) + 1
        steps = max(MIN_STEPS, min(MAX_STEPS, steps))
        round_ = len(self._owners)
        self._per_candidate, self._round = self._broadcast(
            (-(-steps // round_) * round_, round_))
        self.steps = (self._steps + 1, 0)
        # horovod runs with its default cycle now: timed first, without a restart
        self._time(DEFAULT_CYCLE_MS)

    def _time(self, cycle: float) -> None:
        """Time ``cycle`` from the end of the next step on: the engine is waited for at
        both ends, so that a window holds its steps' whole work, whatever the engine
        had queued before it (trainer.step returns while the sums run)."""
        self._current, self._skip, self._timed = cycle, self._round, 0

    def _next(self) -> None:
        # rank 0's times decide for every rank
        self.step_times = self._broadcast(self.step_times)
        default = self.step_times[DEFAULT_CYCLE_MS]
        short = default < SHORT_STEP_CYCLES * LONG_CYCLE_MS / 1e3
        chosen = self.choice()
        if not short and chosen == self._current and self._current != LONG_CYCLE_MS:
            longer = CYCLES_MS[CYCLES_MS.index(self._current) + 1]
            self._time(longer)
            self._restart({CYCLE_ENV: f"{longer:g}"})
            return
        self.steps = (self.steps[0], self._steps)
        self.done = True
        if len(self.step_times) > 1:
            self.settings = {CYCLE_ENV: f"{chosen:g}"}
            if chosen != self._current:
                # the cycle alone: with the fusion threshold also set, horovod 0.28.1
                # crashes at a later start (see the module's docstring)
                self._restart(self.settings)
        if self._rank == 0:
            print(self.summary(), file=sys.stderr, flush=True)

    def choice(self) -> float:
        """The longest cycle timed so far whose step is within :data:`TOLERANCE` of the
        fastest one's."""
        fastest = min(self.step_times.values())
        return max(cycle for cycle, seconds in self.step_times.items()
                   if seconds <= fastest * (1 + TOLERANCE))

    def _keep_default(self) -> None:
        """Chained collectives run: the default cycle from now on, horovod started again
        with it if it runs with another one."""
        self._chained_seen = True
        if not self._enabled or self.reason_not is not None:
            if not self.done:
                self._give_up()
            return
        running = (self._current if not self.done
                   else float(self.settings.get(CYCLE_ENV, DEFAULT_CYCLE_MS)))
        on_other = running is not None and running != DEFAULT_CYCLE_MS
        was_done, self.done = self.done, True
        if was_done and not on_other:
            return
        if on_other:
            self._wait()
            self.settings = {CYCLE_ENV: f"{DEFAULT_CYCLE_MS:g}"}
            self._restart(self.settings)
        if self._rank == 0:
            print(f"dist_gluon: horovod's {CYCLE_ENV} is horovod's default "
                  f"({DEFAULT_CYCLE_MS:g} ms) from step {self._steps} on"
                  + (", started again with it" if on_other else "")
                  + f": {self._chained}, each waiting up to a cycle, so a longer cycle "
                  "cannot pay", file=sys.stderr, flush=True)

    def _give_up(self) -> None:
        self.done = True
        if self._enabled and self._rank == 0:
            print(f"dist_gluon: horovod's cycle time not tuned: {self.reason_not}",
                  file=sys.stderr, flush=True)

    def summary(self) -> str:
        """The line rank 0 prints once the cycle is chosen."""
        cycle = float(self.settings.get(CYCLE_ENV, DEFAULT_CYCLE_MS))
        measured = "step " + ", ".join(f"{seconds * 1e3:.1f} ms at {timed:g} ms"
                                       for timed, seconds in sorted(self.step_times.items()))
        if len(self.step_times) == 1:
            why = (f"shorter than {SHORT_STEP_CYCLES} cycles of {LONG_CYCLE_MS:g} ms, which "
                   "would delay it more than horovod's negotiation costs it")
        elif cycle != DEFAULT_CYCLE_MS:
            why = (f"the longest cycle within {TOLERANCE:.0%} of the fastest step, and a "
                   "waiting rank burns less CPU with a longer cycle")
            if max(self.step_times) > cycle:
                why += "; a longer one was slower"
        else:
            why = f"a longer cycle's step is more than {TOLERANCE:.0%} slower"
        if self._round > 1:
            measured += f" (windows of whole rounds of the {self._round} trainers that take turns)"
        first, last = self.steps
        return (f"dist_gluon: horovod tuned on steps {first}-{last}: {CYCLE_ENV}={cycle:g} "
                f"(ms), kept for the rest of the run; {measured}: {why}; {FUSION_ENV} not "
                f"tuned (horovod 0.28.1 cannot restart with it fixed in the process)")
