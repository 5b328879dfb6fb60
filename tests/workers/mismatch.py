"""Worker script of tests/test_trainer.py: rank 1 builds a different model.

    python mismatch.py deferred|initialised|input

'input': same blocks, but rank 1 feeds 4 features where rank 0 feeds 3, so only the
deferred weight shapes differ, found at the first forward.
"""
import sys

import mxnet as mx
from mxnet import gluon

import dist_gluon as dg

kv = dg.create()
units = 5 if kv.rank == 1 and sys.argv[1] != "input" else 4
features = 4 if kv.rank == 1 and sys.argv[1] == "input" else 3
net = gluon.nn.Sequential()
if sys.argv[1] in ("deferred", "input"):
    net.add(gluon.nn.Dense(8), gluon.nn.Dense(units))
else:
    net.add(gluon.nn.Dense(8, in_units=3), gluon.nn.Dense(units, in_units=8))
net.initialize()
try:
    trainer = dg.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
    net(mx.nd.ones((2, features)))
except dg.ModelMismatchError as err:
    print("caught:", str(err).replace("\n", " | "), flush=True)
    kv.barrier()     # both ranks report before either exits
    sys.exit(3)
print("no error", flush=True)
