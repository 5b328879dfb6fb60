"""Fresh and stale gradients across ranks: one decision for every rank.

``gluon.Trainer`` updates a parameter only if a backward reached it since its last
update (its gradient is *fresh*); with ``ignore_stale_grad=True`` it skips the others.
Decided rank by rank, that lets replicas drift apart: with a rank-dependent branch
(rank 0's samples through head A, the others' through head B) head A is fresh on rank 0
only, so rank 0 updates it and the others skip it, and a stale rank's old gradient
would even be summed into the fresh ranks' update.

Here the decision is the job's, the same on every rank:

1. Each rank reads which of its parameters are fresh (:func:`local_freshness`, a flag
   MXNet keeps per array: no wait) and sends zeros for the stale ones
   (:func:`zero_stale`): a stale rank counts zero, never its old gradient.
2. The flags are summed over the workers with the step's batch sizes (one small array
   that travels first; :meth:`~dist_gluon.averaging._GradientAverager.submit_step`), so
   every rank learns on how many ranks each parameter is fresh.
3. :func:`settle` applies the count on every rank: fresh on any rank, the parameter is
   updated everywhere with the sum of the fresh gradients; stale on every rank, it is
   skipped everywhere. Without ``ignore_stale_grad`` a parameter fresh on some ranks
   and stale on others raises :class:`StaleGradientError` on every rank, naming the
   parameter and the ranks (gluon would raise on the stale ranks only, and the others
   would wait for them).

So the two-head model trains like one process that sends each rank's samples through
that rank's branch.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import mxnet as mx


class StaleGradientError(RuntimeError, UserWarning):
    """A parameter's gradient is fresh on some ranks and stale on others, and the step
    was not asked to ignore stale gradients. A ``UserWarning`` too, as gluon's own
    stale-gradient error, so code that catches that catches this."""


def local_freshness(params: Sequence) -> list[bool]:
    """For each parameter (any order), whether this rank's backward reached it since
    its last update on any of its devices. True for ``grad_req='null'`` (and not yet
    initialised) parameters, which have no gradient that could be stale: so a step
    without a stale gradient reads all True."""
    fresh = []
    for param in params:
        if param.grad_req == "null" or param._data is None:
            fresh.append(True)
        else:
            fresh.append(any(data._fresh_grad for data in param._data))
    return fresh


def zero_stale(param) -> None:
    """Zero the gradients of ``param``'s devices that no backward reached since the
    last update, so that they add nothing to a sum (queued on the engine)."""
    for data, grad in zip(param.list_data(), param.list_grad()):
        if data._fresh_grad:
            continue
        if grad.stype == "default":
            grad[:] = 0
        else:
            mx.nd.sparse.zeros(grad.stype, grad.shape, ctx=grad.context,
                               dtype=grad.dtype).copyto(grad)


def settle(params: Sequence, counts: Sequence[float], ignore_stale_grad: bool,
           num_workers: int, stale_ranks: Callable[[], list[list[int]]],
           describe: Callable[[int], str], step: int | None = None) -> None:
    """Give every rank the same freshness: parameter ``i`` is fresh on every rank if
    ``counts[i]`` (the number of ranks where it was fresh) is positive, stale on every
    rank otherwise. Sets the flags gluon's update reads on each of its devices.

    Without ``ignore_stale_grad``, a parameter fresh on some ranks only raises
    :class:`StaleGradientError` here, on every rank (every rank has the same counts):
    ``stale_ranks()`` (a collective, called on every rank) gives each rank's list of
    stale positions, to name them."""
    partial = [i for i, (param, count) in enumerate(zip(params, counts))
               if param.grad_req != "null" and 0 < count < num_workers]
    if partial and not ignore_stale_grad:
        raise StaleGradientError(_message(partial, stale_ranks(), describe, step))
    for param, count in zip(params, counts):
        if param.grad_req == "null" or param._data is None:
            continue
        for data in param._data:
            data._fresh_grad = count > 0


def _message(partial: list[int], stale_by_rank: list[list[int]],
             describe: Callable[[int], str], step: int | None) -> str:
    first = partial[0]
    stale = [rank for rank, positions in enumerate(stale_by_rank) if first in positions]
    fresh = [rank for rank in range(len(stale_by_rank)) if rank not in stale]
    more = f" (and {len(partial) - 1} more parameters)" if len(partial) > 1 else ""
    when = f" at update {step}" if step is not None else ""
    return (f"{describe(first)}{more} has a fresh gradient on ranks {fresh} but a stale one "
            f"(no backward reached it since its last update) on ranks {stale}{when}. If "
            "the ranks take different branches of the model on purpose, call "
            "step(batch_size, ignore_stale_grad=True): the parameter is then updated on "
            "every rank with the sum of the fresh ranks' gradients (stale ranks count "
            "zero); one stale on every rank is skipped on every rank")
