"""Worker: what plain TCP gets through the emulated links, as a ceiling for the rest.

Run on every host of an emulated cluster at once (standard library only). Host ``i``
streams ``--mib`` MiB to host ``i + 1`` (mod N) while it receives as much from host
``i - 1``: the ring pattern, so every link carries one full stream in each direction,
as in a ring allreduce. All hosts start sending at the wall-clock time ``--start`` (the
namespaces share the machine's clock). Prints one ``LINK {json}`` line: the bytes per
second of the stream this host sent, from the start until the receiver acknowledged
the last byte.
"""
from __future__ import annotations

import argparse
import json
import socket
import threading
import time

CHUNK = 1 << 20


def receive(server: socket.socket, nbytes: int) -> None:
    conn, _ = server.accept()
    with conn:
        left = nbytes
        view = memoryview(bytearray(CHUNK))
        while left:
            got = conn.recv_into(view, min(CHUNK, left))
            if not got:
                raise ConnectionError(f"sender closed with {left} bytes to go")
            left -= got
        conn.sendall(b"k")


def connect(address: str, port: int, deadline: float) -> socket.socket:
    while True:
        try:
            return socket.create_connection((address, port), timeout=30)
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--index", type=int, required=True, help="this host's index")
    parser.add_argument("--addresses", required=True, help="every host's address, comma-separated")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--mib", type=int, default=64, help="MiB each host sends")
    parser.add_argument("--start", type=float, required=True, help="wall-clock start time")
    args = parser.parse_args()
    addresses = args.addresses.split(",")
    nbytes = args.mib << 20
    server = socket.create_server((addresses[args.index], args.port))
    receiver = threading.Thread(target=receive, args=(server, nbytes), daemon=True)
    receiver.start()
    peer = addresses[(args.index + 1) % len(addresses)]
    sock = connect(peer, args.port, deadline=args.start + 20)
    payload = memoryview(bytes(CHUNK))
    time.sleep(max(0.0, args.start - time.time()))
    started = time.perf_counter()
    for offset in range(0, nbytes, CHUNK):
        sock.sendall(payload[:min(CHUNK, nbytes - offset)])
    if sock.recv(1) != b"k":
        raise ConnectionError("no acknowledgement from the receiver")
    seconds = time.perf_counter() - started
    sock.close()
    receiver.join(timeout=60)
    print("LINK " + json.dumps({"index": args.index, "bytes": nbytes, "seconds": seconds}),
          flush=True)


if __name__ == "__main__":
    main()
