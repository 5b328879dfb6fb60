"""The single-process backend: every collective is the identity, nothing is sent."""
from __future__ import annotations

from .base import Backend


class Local(Backend):
    """One process, no communication. ``num_workers`` is 1 and ``rank`` is 0."""

    _type = "local"

    @property
    def rank(self) -> int:
        return 0

    @property
    def num_workers(self) -> int:
        return 1

    @property
    def local_rank(self) -> int:
        return 0
