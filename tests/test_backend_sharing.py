"""Backends shared with plain MXNet code: one key used for several arrays in flight,
gluon.Trainer on a dist_gluon backend, and a second ps-lite store in one process."""
import json

import pytest

from conftest import DISTRIBUTED_BACKENDS, assert_ok, worker_lines

SAME_KEY_AND_PLAIN_TRAINER = """
    import json
    import mxnet as mx
    from mxnet import gluon
    import dist_gluon as dg

    kv = dg.create()
    r = kv.rank
    # two arrays sent under one key without waiting: each must be its own round
    a = mx.nd.ones((1000,)) * (r + 1)
    b = mx.nd.ones((1000,)) * 10 * (r + 1)
    kv.pushpull("k", a)
    kv.pushpull("k", b)
    # gluon.Trainer broadcasts inside its first step, right before the gradient
    # pushpull of the same key
    mx.random.seed(r)
    net = gluon.nn.Dense(2, in_units=3)
    net.initialize()
    trainer = gluon.Trainer(net.collect_params(), "sgd", kvstore=kv, update_on_kvstore=False)
    for _ in range(2):
        with mx.autograd.record():
            loss = net(mx.nd.ones((1, 3)) * (r + 1)).sum()
        loss.backward()
        trainer.step(1)
    # on ps-lite, float arrays travel in their own dtype (integers go as float64)
    h = mx.nd.ones((4,), dtype="float16")
    kv.pushpull("half", h)
    wire = {k: str(v[1]) for k, v in getattr(kv, "_keys", {}).items() if k in ("k", "half")}
    print(json.dumps({"a": a[0].asscalar().item(), "b": b[0].asscalar().item(),
                      "w": net.weight.data().asnumpy().ravel().tolist(), "wire": wire,
                      "half": [h.dtype.__name__, h[0].asscalar().item()]}))
"""


@pytest.mark.parametrize("backend", DISTRIBUTED_BACKENDS)
@pytest.mark.spawns
def test_one_key_in_flight_twice_and_plain_gluon_trainer_stay_exact(tmp_path, backend):
    proc = launch_script(tmp_path, backend, SAME_KEY_AND_PLAIN_TRAINER)
    results = [json.loads(worker_lines(proc.stdout, r)[-1]) for r in (0, 1)]
    for res in results:
        assert (res["a"], res["b"]) == (3.0, 30.0)
        assert res["half"] == ["float16", 2.0]
        if backend != "horovod":
            assert res["wire"] == {"k": "float32", "half": "float16"}
    assert results[0]["w"] == results[1]["w"]


SECOND_STORE = """
    import sys
    import mxnet as mx
    import dist_gluon as dg

    if sys.argv[1] == "dist_gluon_first":
        dg.create()
        make_second = lambda: mx.kv.create("dist_sync")
    else:
        mx.kv.create("dist_sync")
        make_second = dg.create
    try:
        make_second()
    except RuntimeError as err:
        print("caught:", err)
"""


@pytest.mark.parametrize("order", ["dist_gluon_first", "mxnet_first"])
@pytest.mark.spawns
def test_a_second_ps_lite_store_in_one_process_raises_instead_of_blocking(tmp_path, order):
    proc = launch_script(tmp_path, "dist_sync", SECOND_STORE, args=[order])
    for rank in (0, 1):
        caught = [line for line in worker_lines(proc.stdout, rank) if line.startswith("caught")]
        assert caught and "allows one per process" in caught[0]


def launch_script(tmp_path, backend, script, args=()):
    from conftest import launch
    proc = launch(script, tmp_path, backend=backend, args=args, launcher_args=["--timeout", "60"])
    assert_ok(proc)
    return proc
