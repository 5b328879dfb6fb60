"""Gradient compression: codecs that sum gradients over the workers in compressed form.

``compression=`` of DistributedTrainer and DistributedOptimizer takes None, a codec name
or a dict with the name under ``'type'`` and the codec's parameters:

``'fp16'``
    Gradients travel as float16 and come back in their own dtype (as in Horovod).
``'2bit'`` or ``{'type': '2bit', 'threshold': 0.5, 'min_size': 0}``
    MXNet's 2-bit quantisation with error feedback (:class:`TwoBit`), sent packed in
    both directions.
``'powersgd'`` or ``{'type': 'powersgd', 'rank': 4, 'warmup_steps': 0, ...}``
    Low-rank approximation of every matrix-shaped gradient with error feedback and warm
    start (:class:`PowerSGD`, Vogels et al., 2019).

A codec keeps state between steps (residuals, PowerSGD's Q matrices): it is training
state, which :class:`~dist_gluon.Checkpointer` saves and restores. On one process no
codec runs: nothing is sent, and the gradients stay exact.
"""
from __future__ import annotations

from typing import Any

from .base import Codec
from .byteps_compressors import Dithering, OneBit, RandomK, TopK
from .fp16 import FP16
from .powersgd import PowerSGD
from .twobit import TwoBit

CODECS: dict[str, type[Codec]] = {"fp16": FP16, "2bit": TwoBit, "powersgd": PowerSGD}
# BytePS's compressors, with its parameter names (byteps_compressors.py)
CODECS.update({"onebit": OneBit, "topk": TopK, "randomk": RandomK, "dithering": Dithering})


def parse(compression: Any) -> dict | None:
    """Check a ``compression=`` argument; returns ``{'type': name, **params}`` or None.

    Raises
    ------
    ValueError
        An unknown codec name, or parameters the codec does not take or accept.
    """
    if compression is None or compression == "none":
        return None
    if isinstance(compression, str):
        spec = {"type": compression}
    elif isinstance(compression, dict):
        spec = dict(compression)
        if "type" not in spec:
            raise ValueError(f"a compression dict needs a 'type' ({_names()}), got "
                             f"{compression!r}")
    else:
        raise ValueError(f"compression must be None, {_names()} or a dict with 'type', got "
                         f"{compression!r}")
    name = spec["type"]
    if isinstance(name, str):
        name = name.lower()
    if name == "none" and len(spec) == 1:
        return None
    if name not in CODECS:
        raise ValueError(f"unknown compression {spec['type']!r}; valid types are {_names()}")
    spec["type"] = name
    create(spec)            # the codec checks its parameters
    return spec


def create(spec: dict) -> Codec:
    """A new codec from a spec returned by :func:`parse`."""
    params = {k: v for k, v in spec.items() if k != "type"}
    return CODECS[spec["type"]](**params)


def _names() -> str:
    return ", ".join(repr(n) for n in CODECS)


__all__ = ["Codec", "FP16", "TwoBit", "PowerSGD", "CODECS", "parse", "create"]
