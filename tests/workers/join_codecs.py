"""Worker script of tests/test_join.py: rank 0 has 6 batches, rank 1 has 3, inside
``dg.Join``, through each codec with error feedback. Prints, per codec, whether this
rank's own codec state (residuals, errors, momentum) changed while it shadowed the
others' steps, and a digest of its weights (DG_CHECK_SYNC=1 compares the ranks at every
step too).

    python join_codecs.py
"""
import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import dist_gluon as dg

kv = dg.create()
BYTEPS = {"ef": "vanilla", "momentum": "nesterov", "momentum_mu": 0.9}
CODECS = {"2bit": {"type": "2bit"}, "powersgd": {"type": "powersgd"},
          "onebit": {"type": "onebit", **BYTEPS},
          "dithering": {"type": "dithering", "k": 4, **BYTEPS}}
OWN = ("residual.", "error.", "momentum.")

for name, spec in CODECS.items():
    mx.random.seed(3)
    # large enough to be compressed (BytePS leaves tensors under 64 kB alone)
    net = gluon.nn.Sequential()
    net.add(gluon.nn.Dense(256, in_units=128), gluon.nn.Dense(4, in_units=256))
    net.initialize()
    trainer = dg.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.01},
                                    compression=spec)
    rng = np.random.RandomState(kv.rank)
    with dg.Join(trainer):
        for _ in range(6 if kv.rank == 0 else 3):
            with autograd.record():
                loss = (net(mx.nd.array(rng.randn(5, 128))) ** 2).sum()
            loss.backward()
            trainer.step(5)
        left = {k: v.asnumpy() for k, v in trainer.codec.state_arrays().items()
                if k.startswith(OWN)}
    after = {k: v.asnumpy() for k, v in trainer.codec.state_arrays().items()}
    changed = sorted(k for k in left if not np.array_equal(left[k], after[k]))
    digest = sum(float((p.data() ** 2).sum().asscalar())
                 for p in net.collect_params().values())
    print(f"{name}: own state {len(left)} arrays, changed {changed}, "
          f"finite {np.isfinite(digest)}", flush=True)
