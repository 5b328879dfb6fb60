"""Whether a process can start ps-lite a second time: the evidence behind restarting the
workers of ps-lite jobs (dist_gluon/elastic/nodecopy.py).

A worker joins job A (its own scheduler and server on loopback) and sums once; A's
scheduler and server are then killed, as when a node is lost, and job B's started on
another port. In the same process the worker then either frees A's kvstore and creates
one for B (default), or keeps A's and creates one for B (--keep). A watchdog reports
where it is still blocked after --wait seconds and ends the worker.

    python tools/pslite_restart.py [--keep] [--wait 20]

Measured with MXNet 1.9.1: freeing A's kvstore blocks in ps::Finalize (it waits for the
lost scheduler), and a second kvstore blocks in ps::Van::Start (ps-lite's Postoffice is
one per process); neither returns.
"""
import argparse
import os
import subprocess
import sys
import threading
import time


def services(port: int) -> list[subprocess.Popen]:
    env = dict(os.environ, DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=str(port),
               DMLC_NUM_SERVER="1", DMLC_NUM_WORKER="1", OMP_NUM_THREADS="1")
    return [subprocess.Popen([sys.executable, "-c", "import mxnet"],
                             env=dict(env, DMLC_ROLE=role)) for role in ("scheduler", "server")]


def worker(keep: bool, wait: float) -> None:
    import mxnet as mx
    kv = mx.kv.create("dist_sync")
    a = mx.nd.ones((4,))
    kv.init(0, a)
    kv.push(0, a)
    kv.pull(0, out=a)
    print(f"job A: one sum, {a.asnumpy().tolist()}", flush=True)
    print("READY", flush=True)
    sys.stdin.readline()            # A's services are gone, B's started
    os.environ["DMLC_PS_ROOT_PORT"] = os.environ["NEXT_PORT"]
    stage, done = ["freeing job A's kvstore (ps::Finalize)"], threading.Event()

    def watchdog():
        if not done.wait(wait):
            print(f"still blocked after {wait:g} s in: {stage[0]}", flush=True)
            os._exit(3)

    threading.Thread(target=watchdog, daemon=True).start()
    if not keep:
        del kv
    stage[0] = "mx.kv.create('dist_sync') for job B (ps::Van::Start)"
    start = time.time()
    mx.kv.create("dist_sync")
    done.set()
    print(f"job B: joined in {time.time() - start:.1f} s", flush=True)
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keep", action="store_true", help="keep job A's kvstore")
    parser.add_argument("--wait", type=float, default=20.0, help="seconds before giving up")
    parser.add_argument("--port", type=int, default=29981, help="job A's port (B: +1)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.keep, args.wait)
        return
    first = services(args.port)
    argv = [sys.executable, __file__, "--worker", "--wait", str(args.wait)]
    env = dict(os.environ, DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=str(args.port),
               DMLC_NUM_SERVER="1", DMLC_NUM_WORKER="1", DMLC_ROLE="worker",
               NEXT_PORT=str(args.port + 1), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(argv + (["--keep"] if args.keep else []), env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    second = []
    try:
        for line in proc.stdout:
            if line.startswith("READY"):
                break
            print(line, end="")
        for p in first:
            p.kill()
            p.wait()
        print("job A's scheduler and server killed; job B's started", flush=True)
        second = services(args.port + 1)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        for line in proc.stdout:
            print(line, end="")
        print(f"worker exit status {proc.wait()}")
    finally:
        for p in [proc, *first, *second]:
            if p.poll() is None:
                p.kill()
                p.wait()


if __name__ == "__main__":
    main()
