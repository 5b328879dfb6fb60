"""Two workers evaluating a sharded, odd-sized validation set report exactly the
single-process metrics (through the real launcher)."""
from __future__ import annotations

import json
import textwrap

import pytest

from conftest import assert_ok, launch, worker_lines

# Both the workers and the test process build the same data and model from seeded RNGs.
SETUP = """
import mxnet as mx
import numpy as np
from mxnet import gluon

SAMPLES, FEATURES, CLASSES = 101, 8, 3


def true_weights():
    return np.random.RandomState(3).normal(size=(FEATURES, CLASSES))


def validation_set():
    rng = np.random.RandomState(7)
    x = rng.normal(size=(SAMPLES, FEATURES)).astype("float32")
    scores = x @ true_weights() + rng.normal(scale=1.5, size=(SAMPLES, CLASSES))
    return gluon.data.ArrayDataset(x, scores.argmax(axis=1).astype("float32"))


def fixed_model():
    # a linear classifier near the one that made the labels, identical on every rank
    rng = np.random.RandomState(11)
    net = gluon.nn.Dense(CLASSES, in_units=FEATURES)
    net.initialize()
    net.weight.set_data(mx.nd.array(true_weights().T + rng.normal(scale=0.5,
                                                                  size=(CLASSES, FEATURES))))
    net.bias.set_data(mx.nd.array(rng.normal(scale=0.1, size=(CLASSES,))))
    return net


def new_metric():
    return mx.metric.CompositeEvalMetric(
        [mx.metric.Accuracy(), mx.metric.TopKAccuracy(2), mx.metric.CrossEntropy()])


def update(metric, net, batches):
    for data, label in batches:
        metric.update([label], [mx.nd.softmax(net(data))])
    return metric
"""

WORKER = SETUP + """
import json

from dist_gluon.data import ShardSampler, reduce_metric

val_data, net = validation_set(), fixed_model()
sampler = ShardSampler(len(val_data), shuffle=False)
loader = gluon.data.DataLoader(val_data, batch_size=16, sampler=sampler)
metric = update(new_metric(), net, sampler.unpadded(loader))
names, values = reduce_metric(metric).get()
print("local samples", metric.get_metric(0).num_inst)
print("reduced samples", reduce_metric(metric).get_metric(0).num_inst)
print("reduced", json.dumps(dict(zip(names, map(float, values)))))
"""


def single_process_metrics() -> dict[str, float]:
    namespace: dict = {}
    exec(textwrap.dedent(SETUP), namespace)
    val_data = namespace["validation_set"]()
    loader = namespace["gluon"].data.DataLoader(val_data, batch_size=16)
    metric = namespace["update"](namespace["new_metric"](), namespace["fixed_model"](),
                                 loader)
    names, values = metric.get()
    return dict(zip(names, map(float, values), strict=True))


@pytest.mark.parametrize("backend", ["horovod", "dist_sync"])
@pytest.mark.spawns
def test_two_workers_evaluating_101_samples_match_one_process_exactly(tmp_path, backend):
    proc = launch(WORKER, tmp_path, backend=backend, n=2)
    assert_ok(proc)
    expected = single_process_metrics()
    assert 0.5 < expected["accuracy"] < 0.95  # the model is neither useless nor perfect
    for rank, local in enumerate([51, 50]):  # rank 1's last index is padding
        lines = worker_lines(proc.stdout, rank)
        assert f"local samples {local}" in lines
        assert "reduced samples 101" in lines
        reduced = json.loads(next(line for line in lines
                                  if line.startswith("reduced {")).split(" ", 1)[1])
        assert reduced["accuracy"] == expected["accuracy"]
        assert reduced["top_k_accuracy_2"] == expected["top_k_accuracy_2"]
        assert reduced["cross-entropy"] == pytest.approx(expected["cross-entropy"], rel=1e-6)
