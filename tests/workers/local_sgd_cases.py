"""Worker script of tests/test_local_sgd.py: Local SGD and DiLoCo (``sync_every``).

    local_sgd_cases.py OUT train      as N workers (the launcher): every case, each rank's
                                      final weights in OUT/<case>_rank<r>.npz
    local_sgd_cases.py OUT replay N   one process: the same algorithms replayed for N
                                      simulated workers with plain gluon.Trainers and
                                      NumPy averaging, in OUT/<case>_replay.npz
    local_sgd_cases.py OUT restore    one process: the N-worker job's mid-round
                                      checkpoints (OUT/ckpt_<case>) restored, what it
                                      got in OUT/restored_on_one.json

Worker r of N trains on rows [r*B, (r+1)*B) of each step's data; everything starts from
the same weights (rank 0's, seed 100).
"""
import json
import os
import pickle
import sys

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

OUT, MODE = sys.argv[1], sys.argv[2]
B, STEPS, H, FEATURES, CLASSES = 4, 10, 4, 6, 3
SGD = {"learning_rate": 0.1, "momentum": 0.9, "wd": 1e-3}
ADAM = {"learning_rate": 0.01}
NAG = {"learning_rate": 0.7, "momentum": 0.9}
rng = np.random.RandomState(0)
X = rng.randn(STEPS, 8 * B, FEATURES).astype("float32")
Y = rng.randint(0, CLASSES, (STEPS, 8 * B)).astype("float32")
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()

CHECKPOINTED = ("diloco_nag", "diloco_overlap", "diloco_2bit")
# case -> (inner optimizer, its parameters, trainer keywords)
CASES = {
    "per_step": ("sgd", SGD, {}),
    "sync1_outer_sgd": ("sgd", SGD, {"sync_every": 1, "outer_optimizer": "sgd",
                                     "outer_optimizer_params": {"learning_rate": 1.0}}),
    "local": ("sgd", SGD, {"sync_every": H}),
    "local_adam": ("adam", ADAM, {"sync_every": H}),
    "local_warmup": ("sgd", SGD, {"sync_every": H, "local_sgd_warmup": 3}),
    "diloco_sgd1": ("sgd", SGD, {"sync_every": H, "outer_optimizer": "sgd",
                                 "outer_optimizer_params": {"learning_rate": 1.0}}),
    "diloco_nag": ("adam", ADAM, {"sync_every": H, "outer_optimizer": "nag",
                                  "outer_optimizer_params": NAG}),
    "local_fp16": ("sgd", SGD, {"sync_every": H, "compression": "fp16"}),
    # 2-bit pseudo-gradients: each worker's residual carries over to the next round
    "diloco_2bit": ("sgd", SGD, {"sync_every": H, "outer_optimizer": "nag",
                                 "outer_optimizer_params": NAG,
                                 "compression": {"type": "2bit", "threshold": 0.01}}),
    # overlap: a round's update reaches the workers D local steps late
    "local_overlap": ("sgd", SGD, {"sync_every": H, "sync_delay": H}),
    "diloco_overlap": ("adam", ADAM, {"sync_every": H, "outer_optimizer": "nag",
                                      "outer_optimizer_params": NAG, "sync_delay": 3}),
    # worker r's samples go through head r only, stepped with ignore_stale_grad=True:
    # in a local step each worker skips its stale head as gluon does (not even weight
    # decay touches it); per-step warm-up steps update both heads everywhere
    "heads": ("sgd", SGD, {"sync_every": H, "local_sgd_warmup": 2}),
}


class Heads(gluon.nn.HybridBlock):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with self.name_scope():
            self.trunk = gluon.nn.Dense(8, in_units=FEATURES, activation="tanh")
            self.head0 = gluon.nn.Dense(CLASSES, in_units=8)
            self.head1 = gluon.nn.Dense(CLASSES, in_units=8)

    def forward(self, x, head=0):
        return (self.head0 if head == 0 else self.head1)(self.trunk(x))


def make_net(seed, contexts=None, case=None):
    mx.random.seed(seed)
    if case == "heads":
        net = Heads()
    else:
        net = gluon.nn.HybridSequential()
        net.add(gluon.nn.Dense(8, in_units=FEATURES, activation="tanh"),
                gluon.nn.Dense(CLASSES, in_units=8))
    net.initialize(mx.init.Xavier(), ctx=contexts or mx.cpu())
    return net


def weights(net):
    return [p.data().asnumpy() for p in net.collect_params().values()]


def forward_backward(net, step, rank, contexts=None):
    rows = slice(rank * B, (rank + 1) * B)
    if isinstance(net, Heads):
        with autograd.record():
            loss = loss_fn(net(mx.nd.array(X[step, rows]), rank), mx.nd.array(Y[step, rows]))
        loss.backward()
        return
    if contexts is None:
        with autograd.record():
            loss = loss_fn(net(mx.nd.array(X[step, rows])), mx.nd.array(Y[step, rows]))
        loss.backward()
        return
    xs = gluon.utils.split_and_load(X[step, rows], contexts)
    ys = gluon.utils.split_and_load(Y[step, rows], contexts)
    with autograd.record():
        losses = [loss_fn(net(a), b) for a, b in zip(xs, ys)]
    autograd.backward(losses)


# ------------------------------------------------------------------------ N workers
def train_case(dg, kv, case, contexts=None, checkpoint=None):
    optimizer, params, keywords = CASES[case]
    net = make_net(100 + kv.rank, contexts, case)
    trainer = dg.DistributedTrainer(net.collect_params(), optimizer, params, kv=kv,
                                    **keywords)
    for step in range(STEPS):
        forward_backward(net, step, kv.rank, contexts)
        trainer.step(B, ignore_stale_grad=case == "heads")
        if checkpoint is not None and step + 1 == checkpoint[1]:
            checkpoint[0].save(net, trainer, 0, step=step + 1)
    trainer.sync_weights()      # the last round (steps 9-10) is cut short
    for p in net.collect_params().values():
        copies = [d.asnumpy() for d in p.list_data()]
        assert all(np.array_equal(copies[0], c) for c in copies[1:]), p.name
    return net, trainer


def save(case, arrays, rank):
    np.savez(os.path.join(OUT, f"{case}_rank{rank}.npz"),
             **{str(i): a for i, a in enumerate(arrays)})


def train_all():
    import dist_gluon as dg

    kv = dg.create()
    for case in CASES:
        net, _ = train_case(dg, kv, case)
        save(case, weights(net), kv.rank)
    # several devices per worker: each worker sums its two devices' gradients
    net, _ = train_case(dg, kv, "local", contexts=[mx.cpu(0), mx.cpu(1)])
    save("local_2dev", weights(net), kv.rank)
    net, _ = train_case(dg, kv, "diloco_nag", contexts=[mx.cpu(0), mx.cpu(1)])
    save("diloco_nag_2dev", weights(net), kv.rank)

    # a checkpoint 2 steps into the second round (step 6 of 10), then a new model and
    # trainer restored from it that take steps 7-10: the same weights as straight on.
    # With the overlap (D = 3) the first round's sum is still to be applied then.
    for case in CHECKPOINTED:
        ckpt = dg.Checkpointer(os.path.join(OUT, f"ckpt_{case}"), kv=kv)
        net, trainer = train_case(dg, kv, case, checkpoint=(ckpt, 6))
        save(f"straight_{case}", weights(net), kv.rank)
        optimizer, params, keywords = CASES[case]
        net = make_net(300 + kv.rank)
        trainer = dg.DistributedTrainer(net.collect_params(), optimizer, params, kv=kv,
                                        **keywords)
        state = ckpt.restore(net, trainer)
        assert state["step"] == 6 and trainer._local_sgd.in_round == 2, state
        for step in range(6, STEPS):
            forward_backward(net, step, kv.rank)
            trainer.step(B)
        trainer.sync_weights()
        save(f"resumed_{case}", weights(net), kv.rank)
    print("cases done", flush=True)


# ------------------------------------------------------------------------ replay
def replay(case, workers):
    """The algorithm of dist_gluon.local_sgd for ``workers`` simulated workers: plain
    gluon.Trainers, parameters averaged (or DiLoCo's outer NAG/SGD) in NumPy."""
    optimizer, params, keywords = CASES[case]
    every = keywords.get("sync_every", 1)
    warmup = keywords.get("local_sgd_warmup", 0)
    outer = keywords.get("outer_optimizer")
    outer_params = keywords.get("outer_optimizer_params", {})
    delay = keywords.get("sync_delay", 0)
    start = weights(make_net(100, case=case))
    nets = [make_net(100, case=case) for _ in range(workers)]
    trainers = [gluon.Trainer(n.collect_params(), optimizer, dict(params), kvstore=None)
                for n in nets]
    anchor, momentum, in_round = None, None, 0
    pending = None      # (mean pseudo-gradient, each worker's weights at the sync)

    def plist(net):
        return list(net.collect_params().values())

    def begin_sync():
        nonlocal pending, in_round
        at = [weights(n) for n in nets]
        grad = [np.mean([anchor[i] - w[i] for w in at], axis=0) for i in range(len(start))]
        pending, in_round = (grad, at), 0

    def apply(now):
        nonlocal anchor, momentum, pending
        grad, at = pending
        pending = None
        if outer is None or (outer == "sgd" and outer_params["learning_rate"] == 1.0):
            anchor = [a - g for a, g in zip(anchor, grad)]
        else:
            lr, mu = outer_params["learning_rate"], outer_params["momentum"]
            if momentum is None:
                momentum = [np.zeros_like(g) for g in grad]
            momentum = [mu * m + g for m, g in zip(momentum, grad)]
            anchor = [a - lr * (g + mu * m) for a, g, m in zip(anchor, grad, momentum)]
        for n, mine in zip(nets, at):
            for i, p in enumerate(plist(n)):
                value = anchor[i] if now else p.data().asnumpy() + (anchor[i] - mine[i])
                p.set_data(mx.nd.array(value))

    for step in range(STEPS):
        for r, n in enumerate(nets):
            forward_backward(n, step, r)
        if step < warmup or (every == 1 and outer is None):
            # the sum of the fresh gradients; fresh on any worker is fresh on all
            fresh = [[p._data[0]._fresh_grad for p in plist(n)] for n in nets]
            total = [sum(plist(n)[i].grad().asnumpy() for n, f in zip(nets, fresh) if f[i])
                     for i in range(len(start))]
            for n, t in zip(nets, trainers):
                for i, (p, g) in enumerate(zip(plist(n), total)):
                    if any(f[i] for f in fresh):
                        p.grad()[:] = g
                        p._data[0]._fresh_grad = True
                t.step(B * workers, ignore_stale_grad=True)
            continue
        if anchor is None:
            anchor = weights(nets[0])
        for t in trainers:
            t.step(B, ignore_stale_grad=case == "heads")
        in_round += 1
        if pending is not None and in_round >= delay:
            apply(now=False)
        if in_round == every:
            begin_sync()
            if delay == 0:
                apply(now=True)
    if pending is not None:
        apply(now=False)
    if in_round:
        begin_sync()
        apply(now=True)
    return weights(nets[0])


def restore_on_one(case, directory):
    """The N-worker job's mid-round checkpoint on one process: its position, anchor and
    outer state, and saved rank 0's own weights and inner optimizer states (and, with
    a sum pending, that sum and rank 0's weights at the synchronisation)."""
    import dist_gluon as dg

    kv = dg.create("local")
    optimizer, params, keywords = CASES[case]
    net = make_net(7)
    trainer = dg.DistributedTrainer(net.collect_params(), optimizer, params, kv=kv,
                                    **keywords)
    dg.Checkpointer(directory, kv=kv).restore(net, trainer)
    rounds = trainer._local_sgd
    path = sorted(p for p in os.listdir(directory) if p.startswith("ckpt-"))[-1]
    with open(os.path.join(directory, path, "local_sgd.pkl"), "rb") as f:
        saved = pickle.load(f)
    rank0 = saved["local"][0]
    inner = pickle.loads(rank0["inner"])
    mine = trainer._updaters[0].states          # gluon's order
    position = trainer.optimizer_positions()
    result = {
        "steps": rounds.steps, "in_round": rounds.in_round,
        "saved_workers": len(saved["local"]),
        "weights_are_rank0s": all(np.array_equal(w, rank0["weights"][i])
                                  for i, w in enumerate(weights(net))),
        "anchors_equal": all(np.array_equal(rounds._anchors[i].asnumpy(), a)
                             for i, a in saved["shared"]["anchors"].items()),
        "inner_are_rank0s": sorted(inner) == sorted(position) and all(
            np.array_equal(state[0].asnumpy(), inner[position[i]][0].asnumpy())
            for i, state in mine.items()),
        "outer_updates": rounds.outer_updater.optimizer.num_update,
        "pending": rounds._pending,
        "pending_restored": saved["shared"]["pending"] is None or (all(
            np.array_equal(rounds._deltas[i].asnumpy(), d)
            for i, d in saved["shared"]["pending"].items()) and all(
            np.array_equal(rounds._at_sync[i].asnumpy(), a)
            for i, a in rank0["at_sync"].items())),
    }
    result["pending_averaged_over_its_workers"] = None
    if rounds._pending == "late":
        # the restored sum is over the saved job's workers: its outer step takes their
        # average, not the sum over this one process's world
        outer = mx.optimizer.get_updater(
            pickle.loads(pickle.dumps(rounds.outer_updater.optimizer)))
        outer.set_states(rounds.outer_updater.get_states())
        expected = {}
        for i, anchor in rounds._anchors.items():
            expected[i] = anchor.copy()
            outer(i, mx.nd.array(saved["shared"]["pending"][i]) / len(saved["local"]),
                  expected[i])
        rounds._apply(trainer.model_params)
        result["pending_averaged_over_its_workers"] = all(
            np.allclose(rounds._anchors[i].asnumpy(), e.asnumpy(), rtol=0, atol=1e-7)
            for i, e in expected.items())
    return result


if __name__ == "__main__":
    os.makedirs(OUT, exist_ok=True)
    if MODE == "train":
        train_all()
    elif MODE == "replay":
        workers = int(sys.argv[3])
        for case in CASES:
            np.savez(os.path.join(OUT, f"{case}_replay.npz"),
                     **{str(i): a for i, a in enumerate(replay(case, workers))})
    else:
        with open(os.path.join(OUT, "restored_on_one.json"), "w") as f:
            json.dump({case: restore_on_one(case, os.path.join(OUT, f"ckpt_{case}"))
                       for case in CHECKPOINTED}, f)
