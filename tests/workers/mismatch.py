"""Worker script of tests/test_trainer.py: rank 1 builds a different model, once per
case named on the command line, all in one job.

    python mismatch.py initialised|deferred|input ...

'initialised': rank 1's second Dense has 5 units where rank 0's has 4, shapes known at
construction. 'deferred': the same without in_units, so only the biases' shapes are
known before the first forward. 'input': same blocks, but rank 1 feeds 4 features where
rank 0 feeds 3, so only the deferred weight shapes differ, found at the first forward.

Each case builds its model under its own prefix (so the names in the error do not
depend on the cases before it) and prints one line, ``caught <case>: <error>`` or
``no error <case>``; both ranks meet at a barrier after each case. The script exits 3
when any case raised, as a training script that lets the error end it does.
"""
import sys

import mxnet as mx
from mxnet import gluon

import dist_gluon as dg

kv = dg.create()
raised = False
for case in sys.argv[1:]:
    units = 5 if kv.rank == 1 and case != "input" else 4
    features = 4 if kv.rank == 1 and case == "input" else 3
    net = gluon.nn.Sequential(prefix=f"{case}_")
    with net.name_scope():
        if case in ("deferred", "input"):
            net.add(gluon.nn.Dense(8), gluon.nn.Dense(units))
        else:
            net.add(gluon.nn.Dense(8, in_units=3), gluon.nn.Dense(units, in_units=8))
    net.initialize()
    try:
        trainer = dg.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
        net(mx.nd.ones((2, features)))
    except dg.ModelMismatchError as err:
        raised = True
        print(f"caught {case}:", str(err).replace("\n", " | "), flush=True)
    else:
        print(f"no error {case}", flush=True)
    kv.barrier()     # both ranks report before either goes on or exits
if raised:
    sys.exit(3)
