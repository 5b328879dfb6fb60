"""Row-sparse gradients (Embedding with sparse_grad=True) on horovod and dist_sync
(conftest.TRAINING_BACKENDS): 2 workers train like one process on the concatenated batch
(SGD with momentum, lazy Adam, the Module API, mixed with compressed dense layers),
resume exactly from a checkpoint, and send what grows with the rows in use, not with
the vocabulary."""
import json
import sys

import numpy as np
import pytest

from conftest import REPO, TRAINING_BACKENDS, assert_ok, launcher, run
from dist_gluon import sparse

CASES = REPO / "tests" / "workers" / "sparse_cases.py"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    assert_ok(run([sys.executable, str(CASES), str(out), "2"], out))
    return out


@pytest.fixture(scope="module", params=TRAINING_BACKENDS)
def distributed(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    assert_ok(run(launcher(request.param, CASES, out, 2), out))
    return out


def _weights(directory, case, rank):
    data = np.load(directory / f"{case}_rank{rank}.npz")
    return [data[str(i)] for i in range(len(data.files))]


def _max_error(a, b):
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


@pytest.mark.parametrize("case", ["sgd", "lazy_adam", "module"])
@pytest.mark.parametrize("rank", [0, 1])
def test_sparse_gradients_train_like_one_process(distributed, reference, case, rank):
    assert _max_error(_weights(distributed, case, rank), _weights(reference, case, 0)) < 1e-5


def test_sparse_embedding_beside_compressed_dense_layers(distributed, reference):
    ours = _weights(distributed, "sgd_fp16", 0)
    assert _max_error(ours, _weights(reference, "sgd_fp16", 0)) < 1e-3
    assert _max_error(ours, _weights(distributed, "sgd_fp16", 1)) == 0.0


def test_a_resumed_run_with_sparse_gradients_equals_the_uninterrupted_one(distributed):
    for rank in (0, 1):
        assert _max_error(_weights(distributed, "whole", rank),
                          _weights(distributed, "resumed", rank)) == 0.0


def test_what_travels_grows_with_the_rows_in_use_not_the_vocabulary(distributed):
    facts = json.loads((distributed / "sent.json").read_text())
    sent = facts["sent"]
    # each worker's row count, every worker's row ids (padded to the largest count's
    # bucket), then the block of values of the union's rows (6 values a row)
    ids = facts["workers"] * (1 + sparse.bucket(facts["largest"]))
    assert sent["400"] == sent["400000"] == ids + sparse.bucket(facts["rows"]) * 6


@pytest.mark.parametrize("rows,expected", [(0, 1), (1, 1), (2, 2), (3, 4), (31, 32),
                                           (32, 32), (33, 64)])
def test_blocks_are_rounded_up_to_powers_of_two(rows, expected):
    assert sparse.bucket(rows) == expected


class _RecordingKV:
    """One of two workers whose peer sent nothing: records what it is asked to sum."""
    num_workers, rank = 2, 0

    def __init__(self):
        self.sent = []

    def pushpull(self, key, value, priority=0):
        self.sent.append((key, value.dtype))


@pytest.mark.parametrize("wire_dtype,expected", [(None, np.float32), (np.float16, np.float16)])
def test_fp16_compression_sends_the_sparse_rows_as_float16(wire_dtype, expected):
    import mxnet as mx
    grad = mx.nd.sparse.row_sparse_array(
        (mx.nd.ones((2, 4)), mx.nd.array([3, 7], dtype="int64")), shape=(1000, 4))
    kv = _RecordingKV()
    sparse.sum_row_sparse(kv, "emb", grad, wire_dtype=wire_dtype)
    # the row counts and ids travel first (float32), then the values
    assert [key.split(".")[1] for key, _ in kv.sent] == ["counts", "ids2", "rows2"]
    assert [dtype for _, dtype in kv.sent] == [np.float32, np.float32, expected]
    assert grad.indices.asnumpy().tolist() == [3, 7]
    assert grad.data.asnumpy().tolist() == [[1.0] * 4] * 2
