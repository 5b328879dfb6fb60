"""tests/workers/elastic_train.py with node-local checkpoints: every emulated host keeps
its own copy under DIR/disk-<host name>/ckpt (dg.Checkpointer(node_local=True)), as
machines without a shared file system do, so a lost host takes its copy with it.

    python elastic_train_node_local.py DIR [--no-stop-check]
"""
import os
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import elastic_train  # noqa: E402

import dist_gluon as dg  # noqa: E402

_Checkpointer = dg.Checkpointer


def _on_this_host(directory, *args, **kwargs):
    base, name = os.path.split(directory)
    return _Checkpointer(os.path.join(base, f"disk-{socket.gethostname()}", name), *args,
                         node_local=True, **kwargs)


dg.Checkpointer = _on_this_host

if __name__ == "__main__":
    elastic_train.main(sys.argv[1], check_stop="--no-stop-check" not in sys.argv[2:])
