"""dg.Join with the Module API: ``mod.fit`` inside the block, with a DistributedOptimizer
and a data iterator of 3 batches on rank 0 and 5 on rank 1 (and 2 on a third rank), two
epochs, each its own block; each rank compares its weights with one Gluon process
trained on the batches present at each step, and prints the largest difference. With
the argument ``horovod``: Horovod's DistributedOptimizer (dist_gluon.compat), whose
arithmetic is the sum of the present ranks' gradients / (size x batch)."""
import logging
import sys

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import dist_gluon as dg

HOROVOD = sys.argv[1:] == ["horovod"]
if HOROVOD:
    import dist_gluon.compat.horovod as hvd
    hvd.init()
kv = dg.create()
size, rank = kv.num_workers, kv.rank
BATCHES, BATCH = [3, 5, 2][:size], 4
rng = np.random.RandomState(0)
X = rng.randn(2, max(BATCHES), size, BATCH, 6).astype("float32")
Y = rng.randint(0, 3, size=(2, max(BATCHES), size, BATCH)).astype("float32")

data = mx.sym.var("data")
hidden = mx.sym.FullyConnected(data, num_hidden=5, name="fc1")
out = mx.sym.FullyConnected(mx.sym.tanh(hidden), num_hidden=3, name="fc2")
symbol = mx.sym.SoftmaxOutput(out, name="softmax")

mod = mx.mod.Module(symbol, context=mx.cpu())
mod.bind(data_shapes=[("data", (BATCH, 6))], label_shapes=[("softmax_label", (BATCH,))])
mx.random.seed(3)
mod.init_params(mx.init.Xavier())
arg_params, aux_params = mod.get_params()
dg.broadcast_parameters(arg_params)
mod.set_params(arg_params, aux_params)
start = {name: value.copy() for name, value in arg_params.items()}
sgd = mx.optimizer.SGD(learning_rate=0.5, momentum=0.9, rescale_grad=1.0 / BATCH)
opt = hvd.DistributedOptimizer(sgd) if HOROVOD else dg.DistributedOptimizer(sgd)
logging.getLogger().setLevel(logging.ERROR)
for epoch in range(2):
    mine = slice(0, BATCHES[rank])
    train_iter = mx.io.NDArrayIter(X[epoch, mine, rank].reshape(-1, 6),
                                   Y[epoch, mine, rank].reshape(-1), BATCH)
    with dg.Join(opt) as block:
        mod.fit(train_iter, kvstore=None, optimizer=opt, begin_epoch=epoch,
                num_epoch=epoch + 1)
    print(f"epoch {epoch + 1}: last to leave {block.last_joined}", flush=True)

# one Gluon process on the batches present at each step, from the same start
net = gluon.nn.Sequential()
net.add(gluon.nn.Dense(5, in_units=6, activation="tanh"), gluon.nn.Dense(3, in_units=5))
net.initialize()
for param, name in zip(net.collect_params().values(),
                       ("fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias")):
    param.set_data(start[name])
trainer = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.5, "momentum": 0.9})
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
for epoch in range(2):
    for step in range(max(BATCHES)):
        present = [r for r in range(size) if step < BATCHES[r]]
        x = mx.nd.array(np.concatenate([X[epoch, step, r] for r in present]))
        y = mx.nd.array(np.concatenate([Y[epoch, step, r] for r in present]))
        with autograd.record():
            loss = loss_fn(net(x), y)
        loss.backward()
        trainer.step((size if HOROVOD else len(present)) * BATCH)
trained = mod.get_params()[0]
difference = max(float(np.abs(trained[name].asnumpy() - param.data().asnumpy()).max())
                 for param, name in zip(net.collect_params().values(),
                                        ("fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias")))
print(f"largest difference from one process {difference:.2e}", flush=True)
