"""Stress loop for MXNet 1.9's P3 key-creation crash (benchmarks/FINDINGS.md 12b).

Creates ROUNDS x PER_CALL new keys, PER_CALL per pushpull (as a new trainer's first
broadcast does), while MXNet's engine computes, and checks every sum::

    python -m dist_gluon.launch -n 3 --backend p3 -- \\
        python benchmarks/p3_key_stress.py 150 32

Each rank first prints which ps-lite rank it is: the crash, when it comes, is on the
worker that is ps-lite's rank 0 (it makes the init pushes). Run it in loops side by side
on a loaded host; with MXNet 1.9.1 one key per init still crashed 5 of 25 such runs.
"""
import argparse

import mxnet as mx

import dist_gluon as dg


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rounds", type=int, help="pushpull calls, each of new keys")
    parser.add_argument("per_call", type=int, help="new keys in each call")
    args = parser.parse_args()
    kv = dg.create()
    print(f"rank {kv.rank} is ps-lite rank {kv._kv.rank}", flush=True)
    x = mx.nd.ones((32, 32))
    sums = []
    for i in range(args.rounds):
        for _ in range(4):
            mx.nd.dot(x, x)             # the engine computes meanwhile
        batch = [mx.nd.full((1 + j,), kv.rank + 1) for j in range(args.per_call)]
        kv.pushpull([f"stress.{i}.{j}" for j in range(args.per_call)], batch)
        sums += batch
    total = kv.num_workers * (kv.num_workers + 1) // 2
    wrong = sum(int((s.asnumpy() != total).any()) for s in sums)
    if wrong:
        raise SystemExit(f"{wrong} of {len(sums)} sums are wrong")
    if kv.rank == 0:
        print(f"{len(sums)} keys created and summed", flush=True)


if __name__ == "__main__":
    main()
