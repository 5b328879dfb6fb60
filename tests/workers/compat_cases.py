"""The peers' semantics of dist_gluon.compat.horovod and dist_gluon.compat.byteps, checked
against NumPy on any number of workers and any backend (tests/test_compat.py runs it on
2 workers through the launcher, and as one process). Prints one line per group of
checks and 'compat cases passed' at the end; any difference is an AssertionError."""
import os
import warnings

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

import dist_gluon.compat.byteps as bps
import dist_gluon.compat.horovod as hvd


def expect_error(kind, words, function, *args, **kwargs):
    try:
        function(*args, **kwargs)
    except kind as err:
        for word in words:
            assert word in str(err), f"{word!r} not in the {kind.__name__}: {err}"
        return
    raise AssertionError(f"{function.__name__} did not raise {kind.__name__}")


def close(actual, expected, tol=1e-6):
    actual = actual.asnumpy() if isinstance(actual, mx.nd.NDArray) else np.asarray(actual)
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol)


def value(rank, shape=(2, 3)):
    """A rank's data: different on every rank, exact in float32."""
    return (np.arange(np.prod(shape)).reshape(shape) * (rank + 1) + rank).astype("float32")


# ---------------------------------------------------------------- identity
expect_error(ValueError, ["Horovod has not been initialized", "hvd.init()"], hvd.size)
expect_error(ValueError, ["BytePS has not been initialized", "bps.init()"], bps.rank)
hvd.init()
bps.init()
N, r = hvd.size(), hvd.rank()
ranks = range(N)
assert r == int(os.environ.get("DG_RANK", "0")) and N == int(os.environ.get("DG_NUM_WORKERS", 1))
assert (bps.size(), bps.rank(), bps.local_rank(), bps.local_size()) == (N, r, r, N)
assert (hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()) == (r, N, 0, 1)
assert hvd.is_initialized() and hvd.global_process_set.size() == N
print(f"identity: rank {r} of {N}")

# ---------------------------------------------------------------- allreduce
mine = mx.nd.array(value(r))
every = np.stack([value(q) for q in ranks])
close(hvd.allreduce(mine, name="v"), every.mean(0))             # Average by default
close(mine, value(r))                                             # input untouched
close(hvd.allreduce(mine, op=hvd.Sum, name="v"), every.sum(0))
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    close(hvd.allreduce(mine, average=False), every.sum(0))
    close(hvd.allreduce(mine, average=True), every.mean(0))
close(hvd.allreduce(mine, op=hvd.Min), every.min(0))
close(hvd.allreduce(mine, op=hvd.Max), every.max(0))
close(hvd.allreduce(mine, op=hvd.Product), every.prod(0))
close(hvd.allreduce(mine, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25),
      every.sum(0) * 0.5)
close(hvd.allreduce(mine, op=hvd.Average, postscale_factor=3.0), every.mean(0) * 3)
inplace = mine.copy()
assert hvd.allreduce_(inplace, op=hvd.Sum, name="inplace") is inplace
close(inplace, every.sum(0))
# the same name with another shape (ps-lite keys keep their first shape)
close(hvd.allreduce(mx.nd.ones((4,)) * (r + 1), name="v", op=hvd.Sum),
      np.full(4, sum(q + 1 for q in ranks)))
ints = hvd.allreduce(mx.nd.array([r + 1, 10], dtype="int32"), op=hvd.Sum)
assert ints.dtype == np.int32 and ints.asnumpy().tolist() == [N * (N + 1) // 2, 10 * N]
# integers averaged or scaled as horovod does: in double precision, truncated toward zero
mine_ints = np.array([r + 1, -(r + 1), 7 * (r + 1)])
every_ints = np.stack([np.array([q + 1, -(q + 1), 7 * (q + 1)]) for q in ranks])
averaged = hvd.allreduce(mx.nd.array(mine_ints, dtype="int32"))
assert averaged.dtype == np.int32
assert averaged.asnumpy().tolist() == np.trunc(every_ints.sum(0) / N).astype(int).tolist()
scaled = hvd.allreduce(mx.nd.array(mine_ints, dtype="int32"), op=hvd.Sum,
                       prescale_factor=0.5, postscale_factor=3.0)
assert scaled.asnumpy().tolist() == (np.trunc(every_ints * 0.5).sum(0) * 3).tolist()
grouped = hvd.grouped_allreduce([mine, mine * 2], op=hvd.Sum)
close(grouped[0], every.sum(0))
close(grouped[1], 2 * every.sum(0))
expect_error(ValueError, ["supersedes average"], hvd.allreduce, mine, average=True, op=hvd.Sum)
expect_error(NotImplementedError, ["Adasum", "op=Average"], hvd.allreduce, mine, op=hvd.Adasum)
print("allreduce: Average, Sum, Min, Max, Product, scale factors, in place, int32 "
      "(truncated averages), grouped")

# ---------------------------------------------------------------- broadcast
root = N - 1
close(hvd.broadcast(mine, root_rank=root), value(root))
close(mine, value(r))
target = mine.copy()
assert hvd.broadcast_(target, root_rank=0, name="b") is target
close(target, value(0))
expect_error(ValueError, ["root_rank"], hvd.broadcast, mine, root_rank=N)

# ---------------------------------------------------------------- gathers and scatters
part = mx.nd.array(np.full((r + 1, 3), r, dtype="float32"))     # first dims differ
gathered = np.concatenate([np.full((q + 1, 3), q) for q in ranks])
close(hvd.allgather(part), gathered)
close(hvd.grouped_allgather([part, part * 2])[1], gathered * 2)

splits = [j + 1 for j in ranks]                                  # rank j gets j+1 rows
rows = sum(splits)


def sent(q):
    return (np.arange(rows)[:, None] * np.ones((1, 2)) + 100 * q).astype("float32")


received, counts = hvd.alltoall(mx.nd.array(sent(r)), splits=splits)
offset = sum(splits[:r])
close(received, np.concatenate([sent(q)[offset:offset + r + 1] for q in ranks]))
assert counts.asnumpy().tolist() == [r + 1] * N
equal = hvd.alltoall(mx.nd.array(np.arange(2 * N, dtype="float32") + 10 * r))
close(equal, np.concatenate([(np.arange(2 * N) + 10 * q)[2 * r:2 * r + 2] for q in ranks]))

uneven = [value(q, (2 * N + 1, 2)) for q in ranks]
mine_rows = mx.nd.array(uneven[r])
# horovod's split: the first ranks get one row more, as numpy's array_split
close(hvd.reducescatter(mine_rows, op=hvd.Sum), np.array_split(sum(uneven), N)[r])
close(hvd.reducescatter(mine_rows), np.array_split(sum(uneven) / N, N)[r])
expect_error(ValueError, ["Average or Sum"], hvd.reducescatter, mine_rows, op=hvd.Min)

obj = hvd.broadcast_object({"rank": r, "add": lambda x: x + r}, root_rank=root)
assert obj["rank"] == root and obj["add"](1) == 1 + root        # cloudpickled, as horovod
assert hvd.allgather_object(("r", r)) == [("r", q) for q in ranks]
print("broadcast, allgather (uneven), alltoall, reducescatter, objects")

# ---------------------------------------------------------------- what cannot be mapped
expect_error(NotImplementedError, ["add_process_set", "global_process_set"],
             hvd.add_process_set, [0])
if N > 1:                                                         # a strict subset
    expect_error(NotImplementedError, ["process_set", "global_process_set"], hvd.allreduce,
                 mine, process_set=hvd.ProcessSet([0]))
expect_error(NotImplementedError, ["init(comm=...)"], hvd.init, comm=[0])
close(hvd.allreduce(mine, process_set=hvd.ProcessSet(range(N))), every.mean(0))  # all ranks
if os.environ.get("DG_BACKEND", "local") != "horovod":
    expect_error(NotImplementedError, ["start_timeline", "mx.profiler"], hvd.start_timeline,
                 "timeline.json")
if hvd.mpi_enabled():                                             # --transport mpi
    assert isinstance(hvd.mpi_threads_supported(), bool) and not hvd.gloo_enabled()
else:
    expect_error(ValueError, ["MPI is not enabled", "--transport mpi"], hvd.mpi_threads_supported)
print(f"mpi_enabled: {hvd.mpi_enabled()}")
expect_error(NotImplementedError, ["suspend", "--max-restarts"], bps.suspend)
expect_error(NotImplementedError, ["byteps_compressor_type", "compression="],
             bps.byteps_declare_tensor, "c", byteps_compressor_type="onebit")

# ---------------------------------------------------------------- byteps_push_pull
bps.byteps_declare_tensor("pp")
pushed = mx.nd.array(value(r))
assert bps.byteps_push_pull(pushed, name="pp", priority=-1) is None
close(pushed, every.mean(0))                                      # is_average=True
pushed = mx.nd.array(value(r))
bps.byteps_push_pull(pushed, version=0, priority=0, name="pp", is_average=False)
close(pushed, every.sum(0))
expect_error(ValueError, ["'undeclared'", "byteps_declare_tensor"], bps.byteps_push_pull,
             pushed, name="undeclared")
print("byteps_push_pull: average, sum; errors name what to use instead")

# ---------------------------------------------------------------- broadcast_parameters
keys = ["w", "b", "a"]


def filled(rank):
    """A dict whose values say which rank and key they are from, filled in an order that
    differs between ranks: the peers match values by key, not by position."""
    order = keys[rank % 3:] + keys[:rank % 3]
    return {k: mx.nd.full((2,), 10 * rank + keys.index(k)) for k in order}


for api in (hvd, bps):
    params = filled(r)
    api.broadcast_parameters(params, root_rank=root)
    for k in keys:
        close(params[k], np.full(2, 10 * root + keys.index(k)))
assert bps.parameter_index == len(keys)                           # BytePS counts them
mx.random.seed(r)                                                 # different on every rank
deferred = gluon.nn.Dense(3)
deferred.initialize(mx.init.Uniform())
hvd.broadcast_parameters(deferred.collect_params(), root_rank=root)
deferred(mx.nd.ones((1, 4)))                                      # shapes known: broadcast
weights = hvd.allgather_object(deferred.weight.data().asnumpy())
assert all(np.array_equal(w, weights[root]) for w in weights)
expect_error(TypeError, ["DistributedTrainer will broadcast"], bps.broadcast_parameters,
             deferred.collect_params())
if N > 1:                                                         # horovod returns first
    expect_error(ValueError, ["invalid params"], hvd.broadcast_parameters, [mx.nd.ones(2)])
print("broadcast_parameters: dicts matched by key, ParameterDict with deferred shapes")

# ---------------------------------------------------------------- DistributedTrainer
# loss = sum(net(x)) of a linear layer: the gradient is x summed over the batch, whatever
# the weights; each rank has its own batch size B_r = r + 1
LR = 0.1
batch = value(r, (r + 1, 3))
grads = [value(q, (q + 1, 3)).sum(0) for q in ranks]


def linear(start):
    net = gluon.nn.Dense(1, use_bias=False, in_units=3)
    net.initialize(mx.init.Constant(start))
    return net


def backward(net):
    with autograd.record():
        loss = net(mx.nd.array(batch)).sum()
    loss.backward()


def hvd_trainer(**kwargs):
    net = linear(r + 1)
    hvd.broadcast_parameters(net.collect_params(), root_rank=0)   # the trainer does not
    return net, hvd.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": LR},
                                       **kwargs)


# Horovod: sum / (size * this rank's batch size), through rescale_grad
horovod_w = 1.0 - LR * sum(grads) / (N * (r + 1))
for kwargs, tol in (({}, 1e-6), ({"gradient_predivide_factor": 4.0, "num_groups": 2}, 1e-6),
                    ({"compression": hvd.Compression.fp16, "prefix": "fp16."}, 1e-3)):
    net, trainer = hvd_trainer(**kwargs)
    backward(net)
    trainer.step(r + 1)
    close(net.weight.data()[0], horovod_w, tol)
net, trainer = hvd_trainer(gradient_predivide_factor=4.0)
backward(net)
trainer.allreduce_grads()
close(net.weight.grad()[0], sum(grads) / 4.0)                     # horovod's in-between sum
# horovod.mxnet leaves the sum in the gradients when nccl_built() < 21000 (else it averages
# in the allreduce): the answer matches what allreduce_grads() just did
assert hvd.nccl_built() < 21000 and hvd.nccl_built() == 0
trainer.update(r + 1)
close(net.weight.data()[0], horovod_w)
expect_error(ValueError, ["Compression.fp16", "'2bit'"], hvd.DistributedTrainer,
             net.collect_params(), "sgd", compression="fp16")

# BytePS: each rank's gradients / (its batch size * size), summed; root_rank's start
byteps_w = (root + 1) - LR * sum(g / (q + 1) for q, g in enumerate(grads)) / N
for compression_params, tol in ((None, 1e-6), ({"fp16": True}, 1e-3)):
    net = linear(r + 1)                                           # differs between ranks
    trainer = bps.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": LR},
                                     root_rank=root, compression_params=compression_params)
    backward(net)
    trainer.step(r + 1)
    close(net.weight.data()[0], byteps_w, tol)
# BytePS's gc examples' defaults: empty settings, no compression
net = linear(r + 1)
trainer = bps.DistributedTrainer(net.collect_params(), "sgd", {"learning_rate": LR},
                                 root_rank=root, compression_params={
                                     "compressor": "", "ef": None, "momentum": "",
                                     "scaling": False, "k": 1, "fp16": False})
backward(net)
trainer.step(r + 1)
close(net.weight.data()[0], byteps_w)
# onebit with momentum: the optimizer's momentum and wd move into the compression; this
# 12-byte weight travels uncompressed and gets BytePS's weight decay (wdmom) and Nesterov
# momentum (nag) after the sum: g' = (1 + mu) (g + wd w), SGD without momentum or wd
MU, WD = 0.9, 0.01
net = linear(r + 1)
optimizer_params = {"learning_rate": LR, "momentum": MU, "wd": WD}
trainer = bps.DistributedTrainer(net.collect_params(), "sgd", optimizer_params,
                                 root_rank=root, compression_params={
                                     "compressor": "onebit", "ef": "vanilla",
                                     "momentum": "nesterov", "scaling": True})
assert trainer._optimizer.momentum == 0 and trainer._optimizer.wd == 0
codec = trainer._averager.codec                                   # dist_gluon's codec
assert codec.name == "onebit" and codec.scaling and codec.ef == "vanilla" and \
    codec.momentum == "nesterov" and codec.momentum_mu == MU, codec
backward(net)
trainer.step(r + 1)
mean_grad = sum(g / (q + 1) for q, g in enumerate(grads)) / N
close(net.weight.data()[0], (root + 1) - LR * (1 + MU) * (mean_grad + WD * (root + 1)), 1e-5)
assert isinstance(bps.Compression.nag(bps.Compression.none, MU, 1024), bps.Compression.nag)
assert isinstance(bps.Compression.wdmom(bps.Compression.none, MU, WD, 1024),
                  bps.Compression.wdmom)
for params, kind, words in (
        ({"compressor": "twobit"}, ValueError, ["'twobit'", "'onebit'"]),
        ({"compressor": "", "ef": "vanilla"}, ValueError, ["'compressor'"]),
        ({"compressor": "topk"}, KeyError, ["'k'"]),
        ({"compressor": "onebit", "momentum": "nesterov"}, KeyError, ["momentum"]),
        ({"compressor": "onebit", "fp16": True}, NotImplementedError, ["fp16"]),
        ({"compressor": "onebit", "ef": "fancy"}, ValueError, ["'vanilla'"]),
        ({"compressor": "dithering", "k": 2, "partition": "log"}, ValueError, ["partition"])):
    expect_error(kind, words, bps.DistributedTrainer, net.collect_params(), "sgd",
                 {"learning_rate": LR}, compression_params=params)
print("DistributedTrainer: horovod's and BytePS's scaling, predivide, fp16, first broadcast, "
      "BytePS's compression_params")

# ---------------------------------------------------------------- DistributedOptimizer
for api, expected in ((hvd, 1.0 - LR * sum(grads) / (N * (r + 1))),
                      (bps, 1.0 - LR * sum(grads) / N / (r + 1))):
    opt = api.DistributedOptimizer(mx.optimizer.SGD(learning_rate=LR, rescale_grad=1 / (r + 1)))
    updater = mx.optimizer.get_updater(opt)                       # as Module calls it
    weight = mx.nd.ones((3,))
    updater(0, mx.nd.array(grads[r]), weight)
    close(weight, expected)
# Module.fit with each peer's optimizer (kvstore=None) trains a linear regression like
# one process on the N workers' batches together, from rank 0's broadcast weights
B, STEPS = 4, 3
x_all = np.random.RandomState(0).uniform(-1, 1, (STEPS * N * B, 3)).astype("float32")
y_all = x_all @ np.array([1.0, -2.0, 0.5], dtype="float32")
w_ref = np.ones(3)                                                # rank 0's start
for step in range(STEPS):
    xs, ys = x_all[step * N * B:(step + 1) * N * B], y_all[step * N * B:(step + 1) * N * B]
    w_ref = w_ref - LR * ((xs @ w_ref - ys)[:, None] * xs).sum(0) / (N * B)
my_rows = np.concatenate([np.arange(s * N * B + r * B, s * N * B + (r + 1) * B)
                       for s in range(STEPS)])
symbol = mx.sym.LinearRegressionOutput(
    mx.sym.FullyConnected(mx.sym.Variable("data"), num_hidden=1, no_bias=True, name="fc"),
    name="lro")
for api in (hvd, bps):
    data = mx.io.NDArrayIter(x_all[my_rows], y_all[my_rows], B, label_name="lro_label")
    mod = mx.mod.Module(symbol, label_names=["lro_label"], context=mx.cpu())
    mod.bind(data.provide_data, data.provide_label)
    mod.init_params(mx.init.Constant(r + 1))                      # differs between ranks
    arg_params, aux_params = mod.get_params()
    api.broadcast_parameters(arg_params, root_rank=0)
    mod.set_params(arg_params, aux_params)
    opt = api.DistributedOptimizer(mx.optimizer.SGD(learning_rate=LR, rescale_grad=1.0 / B))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                           # Module on rescale_grad
        mod.fit(data, kvstore=None, optimizer=opt, num_epoch=1)
    close(mod.get_params()[0]["fc_weight"].asnumpy()[0], w_ref, 1e-5)
os.environ["BYTEPS_ENABLE_ASYNC"] = "1"
expect_error(NotImplementedError, ["BYTEPS_ENABLE_ASYNC"], bps.DistributedOptimizer,
             mx.optimizer.SGD())
del os.environ["BYTEPS_ENABLE_ASYNC"]
print("DistributedOptimizer: horovod's rescale_grad / size, BytePS's average, Module.fit")

hvd.shutdown()
assert not hvd.is_initialized()
expect_error(ValueError, ["hvd.init()"], hvd.rank)
print("compat cases passed")
