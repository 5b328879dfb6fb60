"""Every launcher that starts within --join-timeout gets in, however many start at once
(``srun`` starts hundreds together): node 0 serves a few hellos at a time and leaves
the other connections queued, and a launcher whose join fails for a reason that can
pass (node 0 not listening yet, or the join dropped) tries again until --join-timeout
(a join dropped before node 0's welcome: test_channel_auth's ``_capture_hello``).

The jobs run one launcher per emulated host, all started together, with a light worker
(a process that does not import MXNet) and node 0 serving at most 2 connections before
their hello (DG_HALF_OPEN_LIMIT=2), a burst four times its limit. The door itself is
tested on loopback, in this process.
"""
from __future__ import annotations

import itertools
import random
import socket
import subprocess
import sys
import threading
import time

import pytest

from conftest import REPO, host_env
from dist_gluon.launch import channel

sys.path.insert(0, str(REPO / "tools"))
import emulated_cluster  # noqa: E402

needs_hosts = pytest.mark.skipif(emulated_cluster.skip_reason() is not None,
                                 reason=str(emulated_cluster.skip_reason()))
SECRET = "the job's secret"

HOSTS = 8
HALF_OPEN = 2
WORKER = "import os; print('rank', os.environ['DG_RANK'], 'of', os.environ['DG_NUM_WORKERS'])"
_ports = itertools.count(29800)


@pytest.fixture(scope="module")
def cluster():
    with emulated_cluster.EmulatedCluster(num_hosts=HOSTS) as c:
        yield c


def start_burst(cluster, nnodes: str, *launcher_args, later=None, hosts: int = HOSTS,
                ranks=None):
    """One launcher on each of the first ``hosts`` hosts, all at once but those in
    ``later`` ({host: seconds}), each started that long after the others; host i is
    node i but those ``ranks`` ({host: node rank}) names; their (exit status, output) by
    host, once all have ended."""
    ranks = ranks or {}
    port = str(next(_ports))
    env = {**host_env(), "DG_JOB_SECRET": f"burst-{port}",
           "DG_HALF_OPEN_LIMIT": str(HALF_OPEN)}
    later = later or {}
    procs = {}
    began = time.monotonic()
    for host in sorted(range(hosts), key=lambda h: later.get(h, 0.0)):
        time.sleep(max(0.0, began + later.get(host, 0.0) - time.monotonic()))
        argv = [sys.executable, "-m", "dist_gluon.launch", "--nnodes", nnodes,
                "--node-rank", str(ranks.get(host, host)),
                "--master-addr", cluster.hosts[0].address, "--master-port", port,
                "-n", "1", "--join-timeout", "60", *launcher_args,
                "--", sys.executable, "-c", WORKER]
        procs[host] = cluster.popen(host, argv, env=env, text=True, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT)
    return {host: (p.wait(timeout=120), p.communicate()[0]) for host, p in procs.items()}


def report(ended) -> str:
    return "\n".join(f"--- node {n} (exit {code})\n{out[-3000:]}"
                     for n, (code, out) in sorted(ended.items()))


@pytest.mark.slow
@needs_hosts
def test_a_static_burst_four_times_the_half_open_limit_gets_every_node_in(cluster):
    # node 0 starts a second after the others: their first joins are refused, and tried
    # again until it listens
    ended = start_burst(cluster, str(HOSTS), later={0: 1.0})
    assert all(code == 0 for code, _ in ended.values()), report(ended)
    for node, (_, out) in ended.items():
        assert f"[{node}] rank {node} of {HOSTS}" in out, report(ended)
    assert f"joined ({HOSTS} of {HOSTS} nodes)" in ended[0][1], report(ended)
    retried = [n for n, (_, out) in ended.items() if "not admitted yet: cannot join the "
               f"job's host at {cluster.hosts[0].address}:" in out and "(Connection "
               "refused); retrying until --join-timeout" in out]
    assert retried, report(ended)
    assert all("joined the job at" in ended[n][1] for n in retried), report(ended)
    assert "dropped the connection" not in ended[0][1], report(ended)


@pytest.mark.slow
@needs_hosts
def test_the_first_nodes_of_a_static_job_wait_longer_than_the_silence_limit_for_the_last(
        cluster):
    # node 0 ticks the nodes that joined while it waits for the others
    ended = start_burst(cluster, "3", "--silence-limit", "1", "--heartbeat", "0.2",
                        later={2: 2.5}, hosts=3)
    assert [ended[n][0] for n in range(3)] == [0, 0, 0], report(ended)
    assert all(f"[{n}] rank {n} of 3" in ended[n][1] for n in range(3)), report(ended)
    assert "lost the master launcher" not in report(ended)


@pytest.mark.slow
@needs_hosts
def test_an_elastic_burst_starts_with_every_launcher_that_reached_node_0(cluster):
    # MAX is twice the nodes started: the job starts after --last-call, with all of them
    ended = start_burst(cluster, f"2:{2 * HOSTS}", "--last-call", "1")
    assert all(code == 0 for code, _ in ended.values()), report(ended)
    for node, (_, out) in ended.items():
        assert f"[{node}] rank {node} of {HOSTS}" in out, report(ended)
    assert f"starting with {HOSTS} nodes of at most {2 * HOSTS} (--nnodes 2:{2 * HOSTS}) " \
           "after" in ended[0][1], report(ended)
    assert "no other launcher joined for --last-call 1 s" in ended[0][1], report(ended)
    assert "left out" not in ended[0][1], report(ended)
    assert f"the job finished on {HOSTS} nodes ({HOSTS} workers)" in ended[0][1], \
        report(ended)


@pytest.mark.slow
@needs_hosts
def test_an_elastic_burst_names_each_launcher_it_left_out_and_why(cluster):
    # hosts 6 and 7 are given node ranks 4 and 5 as well: one of each pair is left out
    ended = start_burst(cluster, f"2:{HOSTS}", "--last-call", "1", ranks={6: 4, 7: 5})
    out = sorted(h for h, (code, _) in ended.items() if code == 2)
    assert len(out) == 2 and sum(code == 0 for code, _ in ended.values()) == HOSTS - 2, \
        report(ended)
    said = ended[0][1]
    assert f"starting with {HOSTS - 2} nodes of at most {HOSTS} " in said, report(ended)
    for host in out:
        rank = {6: 4, 7: 5}.get(host, host)
        why = f"node rank {rank} is taken or out of range [1, {HOSTS})"
        assert why in ended[host][1], report(ended)
        assert f"left out node {rank} ({cluster.hosts[host].name}) at " \
               f"{cluster.hosts[host].address}:" in said and why in said, report(ended)


# ---------------------------------------------------------------------- the door, on loopback
def _join_all(port: int, nodes, timeout: float = 30) -> dict:
    """Launchers of ``nodes`` joining at once, each on a thread; their links by node."""
    links, threads = {}, []
    for node in nodes:
        hello = {"type": "hello", "node": node, "host": f"n{node}", "nproc": 1}
        threads.append(threading.Thread(target=lambda n=node, h=hello: links.update(
            {n: channel.connect_to_master("127.0.0.1", port, h, timeout, SECRET)})))
        threads[-1].start()
    return links, threads


def _hellos(listener, count: int, timeout: float = 30) -> tuple[dict, int]:
    """Poll until ``count`` hellos came in; them by node, and the most connections
    ever on their way in at once."""
    hellos, most = {}, 0
    limit = time.monotonic() + timeout
    while len(hellos) < count and time.monotonic() < limit:
        hellos.update((hello["node"], link) for link, hello in listener.poll())
        most = max(most, len(listener._pending))
        time.sleep(0.01)
    return hellos, most


def test_node_0_serves_a_burst_larger_than_its_half_open_limit_and_drops_none():
    said = []
    listener = channel.Listener(0, SECRET, said.append, "127.0.0.1", backlog=24, half_open=2)
    links, threads = _join_all(listener.port, range(1, 25))
    hellos, most = _hellos(listener, 24)
    for thread in threads:
        thread.join(30)
    assert sorted(hellos) == list(range(1, 25)) and sorted(links) == list(range(1, 25))
    assert most <= 2 and said == []
    listener.close()
    for link in [*links.values(), *hellos.values()]:
        link.close(flush=0)


def test_strangers_holding_every_half_open_place_delay_a_node_by_the_handshake_timeout(
        monkeypatch):
    monkeypatch.setattr(channel, "HANDSHAKE_TIMEOUT", 0.5)
    said = []
    listener = channel.Listener(0, SECRET, said.append, "127.0.0.1", backlog=2, half_open=2)
    squatters = [socket.create_connection(("127.0.0.1", listener.port)) for _ in range(2)]
    listener.poll()                     # both served: the places are taken
    started = time.monotonic()
    links, threads = _join_all(listener.port, [1])
    hellos, _ = _hellos(listener, 1)
    assert list(hellos) == [1] and time.monotonic() - started < 5
    # the second squatter was accepted a moment after the first: the node's hello, let in
    # by the first drop, may come before the second's timeout has passed
    while sum("no hello within 0.5 s; carrying on" in s for s in said) < 2 \
            and time.monotonic() - started < 5:
        assert listener.poll() == []
        time.sleep(0.01)
    assert sum("no hello within 0.5 s; carrying on" in s for s in said) == 2, said
    threads[0].join(30)
    listener.close()
    for sock in squatters:
        sock.close()
    for link in [*links.values(), *hellos.values()]:
        link.close(flush=0)


def test_joins_back_off_with_jitter_up_to_a_cap():
    backoff = channel.Backoff(first=0.1, cap=2.0, rng=random.Random(0))
    waits = [backoff.next() for _ in range(12)]
    bases = [min(2.0, 0.1 * 2 ** n) for n in range(12)]
    assert all(0.5 * b <= w < 1.5 * b for w, b in zip(waits, bases))
    assert len({round(w / b, 6) for w, b in zip(waits, bases)}) == 12   # jittered
    assert backoff.attempts == 12 and max(waits) < 3.0


def test_the_half_open_limit_comes_from_the_environment_and_must_be_positive(monkeypatch,
                                                                            capsys):
    from dist_gluon.launch import cli
    argv = ["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "-n", "1", "--",
            "python", "x.py"]
    monkeypatch.setenv("DG_JOB_SECRET", "a-test-secret-of-enough-length-0123456789")
    assert cli.parse(argv).half_open_limit == channel.HALF_OPEN_LIMIT == 32
    monkeypatch.setenv("DG_HALF_OPEN_LIMIT", "4")
    assert cli.parse(argv).half_open_limit == 4
    for bad in ("0", "many"):
        monkeypatch.setenv("DG_HALF_OPEN_LIMIT", bad)
        with pytest.raises(SystemExit):
            cli.parse(argv)
        assert f"DG_HALF_OPEN_LIMIT must be a positive integer, got '{bad}'" in \
            capsys.readouterr().err
