"""dg.elastic.State on one process: what a commit keeps and a restore puts back, exactly,
even after a failure MXNet stored on the arrays (as a collective that lost its peers
leaves it). The distributed behaviour is tests/test_elastic_memory.py's."""
from __future__ import annotations

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon

import dist_gluon as dg


class _Failing(mx.operator.CustomOp):
    def forward(self, is_train, req, in_data, out_data, aux):
        raise RuntimeError("the collective failed: its peer is gone")

    def backward(self, req, out_grad, in_data, out_data, in_grad, aux):
        pass


@mx.operator.register("dg_test_failing")
class _FailingProp(mx.operator.CustomOpProp):
    def infer_shape(self, in_shape):
        return in_shape, in_shape, []

    def create_operator(self, ctx, shapes, dtypes):
        return _Failing()


def _model(optimizer="sgd", params=None):
    mx.random.seed(1)
    # the same parameter names in every model made: gluon.Trainer orders parameters by
    # name, so 'dense9_' and 'dense10_' (global counters, after other tests in the
    # process) would give two models different indices for the same layer
    net = gluon.nn.HybridSequential(prefix="model_")
    with net.name_scope():
        net.add(gluon.nn.Dense(4, in_units=3), gluon.nn.BatchNorm(in_channels=4),
                gluon.nn.Dense(1, in_units=4))
    net.initialize(mx.init.Xavier())
    trainer = dg.DistributedTrainer(net.collect_params(), optimizer,
                                    params or {"learning_rate": 0.1, "momentum": 0.9},
                                    kv="local")
    return net, trainer


def _step(net, trainer, seed):
    data = mx.nd.array(np.random.RandomState(seed).uniform(-1, 1, (8, 3)))
    with autograd.record():
        loss = (net(data) ** 2).mean()
    loss.backward()
    trainer.step(8)


def _snapshot(net, trainer):
    weights = [p.data().asnumpy() for p in net.collect_params().values()]
    states = {i: [a.asnumpy() for a in (s if isinstance(s, (list, tuple)) else [s])]
              for i, s in trainer._updaters[0].states.items()}
    return weights, states, trainer._optimizer.num_update


def _assert_same(a, b):
    for x, y in zip(a[0], b[0]):
        np.testing.assert_array_equal(x, y)
    assert a[1].keys() == b[1].keys()
    for i in a[1]:
        for x, y in zip(a[1][i], b[1][i]):
            np.testing.assert_array_equal(x, y)
    assert a[2] == b[2]


@pytest.mark.parametrize("optimizer,params", [
    ("sgd", {"learning_rate": 0.1, "momentum": 0.9}),
    ("adam", {"learning_rate": 0.01})])
def test_restore_puts_back_the_last_commit_exactly(optimizer, params):
    net, trainer = _model(optimizer, params)
    state = dg.elastic.State(net=net, trainer=trainer, epoch=0, seen=[])
    state.sync()
    for i in range(3):
        _step(net, trainer, i)
        state.seen.append(i)
        state.commit()
    kept = _snapshot(net, trainer)
    for i in range(3, 5):               # steps after the commit, to be undone
        _step(net, trainer, i)
        state.seen.append(i)
        state.epoch = 1
    state.restore()
    _assert_same(_snapshot(net, trainer), kept)
    assert (state.epoch, state.seen) == (0, [0, 1, 2])
    # and training goes on from there as it would have
    _step(net, trainer, 3)
    again = _snapshot(net, trainer)
    other_net, other_trainer = _model(optimizer, params)
    for i in range(4):
        _step(other_net, other_trainer, i)
    _assert_same(again, _snapshot(other_net, other_trainer))


def test_a_failure_stored_on_the_arrays_is_cleared_and_the_last_clean_commit_restored():
    net, trainer = _model()
    state = dg.elastic.State(net=net, trainer=trainer, step=0)
    state.sync()
    for i in range(2):
        _step(net, trainer, i)
        state.step += 1
        state.commit()
    kept = _snapshot(net, trainer)
    # a step whose gradient "sum" fails: MXNet stores the failure on the gradient, the
    # update that reads it skips and passes it on to the weights and optimizer states,
    # and the commit's copies of them carry it too
    data = mx.nd.ones((8, 3))
    with autograd.record():
        loss = (net(data) ** 2).mean()
    loss.backward()
    weight = net[0].weight
    mx.nd.Custom(weight.grad(), op_type="dg_test_failing", out=weight.grad())
    trainer.step(8)
    state.step += 1
    with pytest.raises(mx.base.MXNetError, match="custom"):
        state.commit()                  # its copies carry the step's failure
    state.restore()
    _assert_same(_snapshot(net, trainer), kept)
    assert state.step == 2
    _step(net, trainer, 2)              # nothing left over on any array
    mx.nd.waitall()
    state.commit()
    state.commit()


def test_the_state_names_its_values_and_refuses_others():
    net, trainer = _model()
    with pytest.raises(ValueError, match="the model .net=. or the trainer"):
        dg.elastic.State()
    with pytest.raises(ValueError, match="'commit' cannot be a value"):
        dg.elastic.State(net=net, commit=1)
    state = dg.elastic.State(net=net, trainer=trainer, epoch=3)
    assert state.epoch == 3
    with pytest.raises(AttributeError, match="'epochs' is not a value of this state"):
        state.epochs = 4
    with pytest.raises(AttributeError, match="no value 'batch'.*epoch"):
        _ = state.batch
    with pytest.raises(RuntimeError, match="restore.. before any commit"):
        state.restore()


def test_without_a_launcher_run_syncs_once_calls_back_never_and_returns():
    net, trainer = _model()
    state = dg.elastic.State(net=net, trainer=trainer, epoch=0)
    calls = []
    state.register_reset_callbacks([lambda: calls.append("reset")])

    @dg.elastic.run
    def train(state, epochs):
        for epoch in range(state.epoch, epochs):
            state.epoch = epoch
            _step(net, trainer, epoch)
            state.commit()
        return state.epoch

    assert train(state, 3) == 2
    assert calls == [] and state.commits == 4      # sync's commit, then one per step
    with pytest.raises(TypeError, match="must be a dist_gluon.elastic.State"):
        train(None, 1)


# ---------------------------------------------------------------- Local SGD, codecs
class _OneWorker:
    """A backend of one worker whose sum is the identity: the codecs' error feedback
    runs as in a job of several workers (on one process no codec runs)."""
    num_workers, rank, type = 1, 0, "local"
    _exact_integers = ("int32", 31)

    def pushpull(self, key, value, out=None, priority=0):
        pass


def _rounds_model(compression="2bit", sync_delay=0):
    mx.random.seed(1)
    net = gluon.nn.HybridSequential(prefix="model_")     # the same names: see _model
    with net.name_scope():
        net.add(gluon.nn.Dense(8, in_units=3), gluon.nn.Dense(1, in_units=8))
    net.initialize(mx.init.Xavier())
    trainer = dg.DistributedTrainer(
        net.collect_params(), "sgd", {"learning_rate": 0.1, "momentum": 0.9}, kv="local",
        sync_every=4, outer_optimizer="nag", sync_delay=sync_delay, compression=compression,
        outer_optimizer_params={"learning_rate": 0.7, "momentum": 0.9})
    return net, trainer


def _rounds_step(net, trainer, seed):
    """A step, then both codecs' error feedback (the gradients' and the
    pseudo-gradients') on arrays of this step."""
    _step(net, trainer, seed)
    params = trainer.model_params
    for codec, scale, key in ((trainer.codec, 1.0, "g"),
                              (trainer._local_sgd.codec, 0.01, "o")):
        grads = [p.grad() * scale for p in params]
        codec.reduce(_OneWorker(), list(range(len(params))),
                     [f"{key}{i}" for i in range(len(params))], grads, 0)


def _rounds_snapshot(net, trainer):
    rounds = trainer._local_sgd
    arrays, counters = trainer.extra_state()
    return (_snapshot(net, trainer), {k: a.asnumpy() for k, a in arrays.items()},
            (rounds.steps, rounds.in_round, rounds.synchronisations, rounds._pending,
             rounds.outer_updater.optimizer.num_update))


def _assert_rounds_same(a, b):
    _assert_same(a[0], b[0])
    assert sorted(a[1]) == sorted(b[1])
    for name in a[1]:
        np.testing.assert_array_equal(a[1][name], b[1][name], err_msg=name)
    assert a[2] == b[2]


@pytest.mark.parametrize("compression,sync_delay", [
    ("2bit", 0), ({"type": "powersgd", "rank": 1, "min_compression_rate": 0}, 3),
    ({"type": "onebit", "ef": "vanilla", "min_compress_bytes": 0}, 0)])
def test_restore_keeps_the_local_sgd_round_and_the_codecs_residuals_exactly(compression,
                                                                            sync_delay):
    net, trainer = _rounds_model(compression, sync_delay)
    state = dg.elastic.State(net=net, trainer=trainer)
    state.sync()
    for i in range(6):          # one synchronisation, then 2 steps into the second round
        _rounds_step(net, trainer, i)
        state.commit()
    kept = _rounds_snapshot(net, trainer)
    names = kept[1]
    assert any(n.startswith("rounds.anchor.") for n in names)
    # with the overlap (D = 3) the first synchronisation's sum is still pending
    assert any(n.startswith("rounds.sum." if sync_delay else "rounds.outer.") for n in names)
    assert trainer._local_sgd._pending == ("late" if sync_delay else None)
    assert any(n.startswith("codec.") for n in names)
    assert any(n.startswith("rounds.codec.") for n in names)
    assert kept[2][:2] == (6, 2)
    for i in range(6, 9):       # across the next synchronisation: all of it moves
        _rounds_step(net, trainer, i)
    assert trainer._local_sgd.synchronisations == 2
    state.restore()
    _assert_rounds_same(_rounds_snapshot(net, trainer), kept)
    for i in range(6, 12):
        _rounds_step(net, trainer, i)
    other_net, other_trainer = _rounds_model(compression, sync_delay)
    for i in range(12):
        _rounds_step(other_net, other_trainer, i)
    _assert_rounds_same(_rounds_snapshot(net, trainer),
                        _rounds_snapshot(other_net, other_trainer))


def test_a_restore_to_before_the_first_round_drops_what_the_round_made_since():
    net, trainer = _rounds_model()
    state = dg.elastic.State(net=net, trainer=trainer)
    state.sync()                # no anchor, outer state or residual yet
    for i in range(5):
        _rounds_step(net, trainer, i)
    state.restore()
    assert trainer.extra_state()[0] == {}
    assert trainer._local_sgd.outer_updater.states == {}
    for i in range(4):
        _rounds_step(net, trainer, i)
    other_net, other_trainer = _rounds_model()
    for i in range(4):
        _rounds_step(other_net, other_trainer, i)
    _assert_rounds_same(_rounds_snapshot(net, trainer),
                        _rounds_snapshot(other_net, other_trainer))


def test_a_new_worker_takes_the_round_from_the_layout_and_arrays_of_a_peer():
    # State.sync's path on a new worker, on one process: rank 0's layout, then its
    # arrays by key (the broadcast)
    net, trainer = _rounds_model()
    state = dg.elastic.State(net=net, trainer=trainer)
    for i in range(6):
        _rounds_step(net, trainer, i)
    state.commit()
    new_net, new_trainer = _rounds_model()
    new_net(mx.nd.ones((1, 3)))
    joiner = dg.elastic.State(net=new_net, trainer=new_trainer)
    joiner._take_layout(state._layout())
    keys, arrays = state._keyed_arrays()
    new_keys, new_arrays = joiner._keyed_arrays()
    assert new_keys == keys
    for source, target in zip(arrays, new_arrays):
        source.copyto(target)
    _assert_rounds_same(_rounds_snapshot(new_net, new_trainer),
                        _rounds_snapshot(net, trainer))
    for i in range(6, 12):
        _rounds_step(net, trainer, i)
        _rounds_step(new_net, new_trainer, i)
    _assert_rounds_same(_rounds_snapshot(new_net, new_trainer),
                        _rounds_snapshot(net, trainer))


@pytest.mark.parametrize("compression, own", [
    ("2bit", ("residual",)),
    ({"type": "powersgd", "rank": 1, "min_compression_rate": 0}, ("error",)),
    ({"type": "onebit", "ef": "vanilla", "min_compress_bytes": 0}, ("momentum", "error"))])
def test_a_trainer_names_its_codecs_residuals_as_each_ranks_own(compression, own):
    # what a worker healing from a peer starts at zero instead of copying (State.sync):
    # the residuals of both codecs, not the round's anchor, outer state or PowerSGD's Q
    net, trainer = _rounds_model(compression)
    for i in range(6):
        _rounds_step(net, trainer, i)
    names = set(trainer.extra_state()[0])
    private = trainer.private_state_names()
    assert private == {n for n in names
                       if n.split(".")[-2] in own and n.startswith(("codec.", "rounds.codec."))}
    assert any(n.startswith("codec.") for n in private)
    assert any(n.startswith("rounds.codec.") for n in private)
    assert any(n.startswith("rounds.anchor.") for n in names - private)


def test_the_sync_checks_count_is_restored_and_taken_by_a_new_worker():
    # the count decides at which steps the ranks compare their weights (a collective):
    # a rank restored or healed from a peer must be at the same count as its peers
    net, trainer = _model()
    state = dg.elastic.State(net=net, trainer=trainer)
    state.sync()
    for i in range(3):
        _step(net, trainer, i)
    state.commit()
    for i in range(3, 5):
        _step(net, trainer, i)
    assert trainer._sync_check.steps == 5
    state.restore()
    assert trainer._sync_check.steps == 3
    new_net, new_trainer = _model()
    dg.elastic.State(net=new_net, trainer=new_trainer)._take_layout(state._layout())
    assert new_trainer._sync_check.steps == 3


def test_the_errors_of_a_lost_peer_are_told_from_the_scripts_own():
    """What a collective raises when a peer or its connection is gone (horovod's shutdown
    after a Gloo error; a connection reset, closed, or aborted by this host's TCP stack,
    as ``ss -K`` or a keepalive failure does: ECONNABORTED) ends the round for
    dist_gluon.elastic.run; any other error is the script's and propagates."""
    from dist_gluon.elastic.rounds import _LOST_PEER
    for message in ("MXNetError: Horovod has been shut down. This was caused by ...",
                    "Read error [127.0.0.1]:2946: Connection reset by peer",
                    "Connection closed by peer [10.0.0.2]:4021",
                    "MXNetError: Software caused connection abort",
                    "[gloo/transport/tcp/pair.cc:598] Connection closed by peer",
                    "Timed out waiting 30000ms for recv operation to complete"):
        assert _LOST_PEER.search(message), message
    for message in ("ValueError: shapes (3,) and (4,) differ",
                    "RuntimeError: CUDA out of memory"):
        assert not _LOST_PEER.search(message), message
