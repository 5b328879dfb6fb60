"""The Gloo rendezvous and the job environment the launcher gives workers, without
importing mxnet or horovod (dist_gluon.launch.rendezvous,
dist_gluon.launch.jobenv)."""
from __future__ import annotations

import http.client
import ipaddress
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from conftest import REPO
from dist_gluon.launch.jobenv import (
    _proc_route_iface,
    gloo_iface,
    horovod_worker_env,
    loopback_hostname_error,
    pslite_env,
    pslite_role_env,
    resolves_to_loopback,
    route_iface,
    route_source_addr,
    worker_layout,
)
from dist_gluon.launch.rendezvous import GlooRendezvous

PYTHON = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv").exists() else sys.executable

HOROVOD_WORKER = r"""
import horovod.mxnet as hvd
import mxnet as mx
hvd.init()
summed = hvd.allreduce(mx.nd.ones((4,)) * (hvd.rank() + 1), average=False, name="x")
print("RESULT", hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(),
      hvd.cross_rank(), hvd.cross_size(), summed.asnumpy().tolist(), flush=True)
"""


def request(port: int, method: str, path: str, body: bytes | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, body=body)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


@pytest.fixture
def rendezvous():
    with GlooRendezvous("127.0.0.1") as server:
        yield server


def own_non_loopback_address() -> str | None:
    try:
        addr = route_source_addr("192.0.2.123")  # TEST-NET-1: only asks for a route
    except OSError:
        return None
    return None if ipaddress.ip_address(addr).is_loopback else addr


# --- the key-value protocol of horovod's Gloo HTTP store -------------------------------

def test_a_key_is_404_until_it_is_put_then_returns_the_exact_bytes(rendezvous):
    value = bytes(range(256)) * 4096  # binary, with NULs, 1 MiB
    assert request(rendezvous.port, "GET", "/global/0") == (404, b"")
    assert request(rendezvous.port, "PUT", "/global/0", value) == (200, b"")
    assert request(rendezvous.port, "GET", "/global/0") == (200, value)


def test_put_replaces_the_value_and_scopes_are_independent(rendezvous):
    request(rendezvous.port, "PUT", "/global/rank_0", b"old")
    request(rendezvous.port, "PUT", "/global/rank_0", b"new")
    request(rendezvous.port, "PUT", "/local_h1/rank_0", b"other scope")
    assert request(rendezvous.port, "GET", "/global/rank_0") == (200, b"new")
    assert request(rendezvous.port, "GET", "/local_h1/rank_0") == (200, b"other scope")
    assert request(rendezvous.port, "GET", "/local_h2/rank_0") == (404, b"")


def test_delete_removes_only_the_named_key_and_tolerates_missing_ones(rendezvous):
    request(rendezvous.port, "PUT", "/global/0", b"a")
    request(rendezvous.port, "PUT", "/global/1", b"b")
    assert request(rendezvous.port, "DELETE", "/global/0") == (200, b"")
    assert request(rendezvous.port, "DELETE", "/global/0") == (200, b"")
    assert request(rendezvous.port, "DELETE", "/nowhere/7") == (200, b"")
    assert request(rendezvous.port, "GET", "/global/0") == (404, b"")
    assert rendezvous.keys("global") == ["1"]


def test_a_path_that_is_not_scope_and_key_is_a_bad_request(rendezvous):
    assert request(rendezvous.port, "GET", "/global")[0] == 400
    assert request(rendezvous.port, "PUT", "/a/b/c", b"x")[0] == 400


def test_reset_forgets_every_key_for_the_next_attempt(rendezvous):
    request(rendezvous.port, "PUT", "/global/0", b"stale address")
    rendezvous.reset()
    assert request(rendezvous.port, "GET", "/global/0") == (404, b"")
    assert rendezvous.keys("global") == []


def test_a_fresh_rendezvous_can_take_the_port_of_a_stopped_one():
    first = GlooRendezvous("127.0.0.1")
    port = first.start()
    request(port, "PUT", "/global/0", b"x")
    first.stop()
    first.stop()  # idempotent
    with GlooRendezvous("127.0.0.1", port) as second:
        assert second.port == port
        assert request(port, "GET", "/global/0") == (404, b"")


def test_start_twice_and_port_before_start_are_errors():
    server = GlooRendezvous("127.0.0.1")
    with pytest.raises(RuntimeError, match="not running"):
        server.port  # noqa: B018
    server.start()
    try:
        with pytest.raises(RuntimeError, match="already running"):
            server.start()
    finally:
        server.stop()
    with pytest.raises(ValueError, match="port"):
        GlooRendezvous("127.0.0.1", 70000)


def test_many_polling_clients_are_served_and_nothing_is_logged(rendezvous, capfd):
    # Waiting Gloo workers open a new connection every 10 ms each.
    results = []

    def poll(rank):
        key = f"/global/{(rank + 1) % 32}"
        request(rendezvous.port, "PUT", f"/global/{rank}", str(rank).encode())
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            status, body = request(rendezvous.port, "GET", key)
            if status == 200:
                results.append(body)
                return
            time.sleep(0.01)

    threads = [threading.Thread(target=poll, args=(rank,)) for rank in range(32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == sorted(str(r).encode() for r in range(32))
    request(rendezvous.port, "GET", "/bad")
    out, err = capfd.readouterr()
    assert out == "" and err == ""


# --- the environment of a horovod worker -------------------------------------------------

def test_worker_layout_numbers_ranks_node_by_node_as_horovodrun_does():
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts

    for slots in ([2, 2], [1, 1, 1], [3, 1, 2], [4]):
        hosts = ",".join(f"h{i}:{n}" for i, n in enumerate(slots))
        expected = get_host_assignments(parse_hosts(hosts), sum(slots))
        ours = [worker_layout(slots, node, local)
                for node, n in enumerate(slots) for local in range(n)]
        assert [(s.rank, s.size, s.local_rank, s.local_size, s.cross_rank, s.cross_size)
                for s in expected] == [tuple(layout) for layout in ours]
    assert worker_layout([2, 2], node_rank=1, local_rank=1).rank == 1 * 2 + 1


def test_worker_layout_rejects_positions_outside_the_job():
    with pytest.raises(ValueError, match="node_rank"):
        worker_layout([2, 2], 2, 0)
    with pytest.raises(ValueError, match="local_rank"):
        worker_layout([2, 1], 1, 1)
    with pytest.raises(ValueError, match="slots_per_node"):
        worker_layout([], 0, 0)


def test_horovod_worker_env_is_exactly_the_static_gloo_variables():
    env = horovod_worker_env("10.0.0.1", 29500, "eth0", "node1",
                             **worker_layout([2, 2], 1, 1)._asdict())
    assert env == {
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.1",
        "HOROVOD_GLOO_RENDEZVOUS_PORT": "29500",
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_IFACE": "eth0",
        "HOROVOD_HOSTNAME": "node1",
        "HOROVOD_RANK": "3",
        "HOROVOD_SIZE": "4",
        "HOROVOD_LOCAL_RANK": "1",
        "HOROVOD_LOCAL_SIZE": "2",
        "HOROVOD_CROSS_RANK": "1",
        "HOROVOD_CROSS_SIZE": "2",
    }
    timed = horovod_worker_env("10.0.0.1", 29500, "eth0", "node1", 0, 1, 0, 1, 0, 1,
                               timeout_seconds=120)
    assert timed["HOROVOD_GLOO_TIMEOUT_SECONDS"] == "120"


@pytest.mark.parametrize("change, message", [
    ({"rank": 4}, "rank must be in"),
    ({"local_rank": -1}, "local_rank must be in"),
    ({"cross_rank": 2}, "cross_rank must be in"),
    ({"hostname": "a/b"}, "hostname"),
    ({"hostname": ""}, "hostname"),
    ({"iface": ""}, "iface"),
    ({"rendezvous_port": 0}, "rendezvous_port"),
])
def test_horovod_worker_env_rejects_impossible_values(change, message):
    args = dict(rendezvous_addr="10.0.0.1", rendezvous_port=29500, iface="eth0",
                hostname="node1", **worker_layout([2, 2], 1, 1)._asdict())
    args.update(change)
    with pytest.raises(ValueError, match=message):
        horovod_worker_env(**args)


# --- the environment of a ps-lite job ----------------------------------------------------

def test_pslite_env_names_the_scheduler_and_this_nodes_address():
    assert pslite_env("10.0.0.1", 9000, 4, 2, "10.0.0.2", p3=False) == {
        "DMLC_PS_ROOT_URI": "10.0.0.1",
        "DMLC_PS_ROOT_PORT": "9000",
        "DMLC_NODE_HOST": "10.0.0.2",
        "DMLC_NUM_SERVER": "2",
        "DMLC_NUM_WORKER": "4",
    }
    p3 = pslite_env("10.0.0.1", 9000, 4, 2, "10.0.0.2", p3=True)
    assert p3["DMLC_PS_VAN_TYPE"] == "p3" and p3["MXNET_UPDATE_ON_KVSTORE"] == "0"
    assert pslite_role_env("server") == {"DMLC_ROLE": "server"}


def test_pslite_env_rejects_host_names_which_zeromq_cannot_bind():
    with pytest.raises(ValueError, match="root_uri must be a numeric IPv4"):
        pslite_env("localhost", 9000, 1, 1, "127.0.0.1", p3=False)
    with pytest.raises(ValueError, match="node_host must be a numeric IPv4"):
        pslite_env("127.0.0.1", 9000, 1, 1, "node1", p3=False)
    with pytest.raises(ValueError, match="role must be one of"):
        pslite_role_env("master")


# --- network facts ------------------------------------------------------------------------

def test_loopback_and_own_addresses_route_through_lo():
    assert route_iface("127.0.0.1") == "lo"
    assert route_source_addr("127.0.0.1") == "127.0.0.1"
    assert gloo_iface("127.0.0.1") == "lo"
    own = own_non_loopback_address()
    if own is not None:
        assert route_iface(own) == "lo"
        assert route_source_addr(own) == own


def test_on_the_master_gloo_announces_the_interface_carrying_its_address():
    own = own_non_loopback_address()
    if own is None:
        pytest.skip("this host has no non-loopback IPv4 address")
    # The kernel routes the master's own address through lo, but workers on other nodes
    # must be told an address they can reach.
    assert gloo_iface(own) == route_iface("192.0.2.123") != "lo"


def test_without_ip_the_route_comes_from_proc_net_route_by_longest_prefix(tmp_path):
    table = tmp_path / "route"
    table.write_text(
        "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n"
        "eth0\t00000000\t0100000A\t0003\t0\t0\t100\t00000000\t0\t0\t0\n"
        "eth1\t0000010A\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0\n"
        "eth2\t0002010A\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n"
        "eth3\t0003010A\t00000000\t0000\t0\t0\t0\t00FFFFFF\t0\t0\t0\n")
    assert _proc_route_iface("10.1.2.9", str(table)) == "eth2"   # 10.1.2.0/24
    assert _proc_route_iface("10.1.7.9", str(table)) == "eth1"   # 10.1.0.0/16
    assert _proc_route_iface("10.1.3.9", str(table)) == "eth1"   # eth3's route is down
    assert _proc_route_iface("8.8.8.8", str(table)) == "eth0"    # default


def test_a_loopback_host_name_is_detected_and_the_message_names_the_fix():
    assert resolves_to_loopback("localhost")
    own = own_non_loopback_address()
    if own is not None:
        assert not resolves_to_loopback(own)
    message = loopback_hostname_error("h1", "127.0.1.1", "10.0.0.2", node_rank=1)
    assert "node 1" in message and "'h1' resolves to 127.0.1.1" in message
    assert "/etc/hosts" in message and "10.0.0.2 h1" in message
    assert "--iface cannot fix" in message


def test_the_modules_import_neither_mxnet_nor_horovod():
    # By file path, so that the package's own __init__ is not part of the measurement.
    script = (
        "import importlib.util, sys\n"
        "for name in ('jobenv', 'rendezvous'):\n"
        f"    spec = importlib.util.spec_from_file_location(name, r'{REPO}/dist_gluon/launch/'"
        " + name + '.py')\n"
        "    spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('mxnet', 'horovod', 'numpy', 'dist_gluon')))\n")
    out = subprocess.run([PYTHON, "-c", script], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    assert out.strip() == "[]"


# --- real horovod workers, given only this environment ------------------------------------

def run_horovod_job(node_labels: list[str], workers_per_node: int) -> list[list]:
    """Start len(node_labels) x workers_per_node horovod workers on loopback, meeting at a
    GlooRendezvous; returns each rank's RESULT fields."""
    slots = [workers_per_node] * len(node_labels)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", "DMLC_"))}
    base.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    procs = []
    with GlooRendezvous("127.0.0.1") as server:
        try:
            for node, label in enumerate(node_labels):
                for local_rank in range(workers_per_node):
                    env = dict(base, **horovod_worker_env(
                        "127.0.0.1", server.port, "lo", label, timeout_seconds=30,
                        **worker_layout(slots, node, local_rank)._asdict()))
                    procs.append(subprocess.Popen(
                        [PYTHON, "-c", HOROVOD_WORKER], env=env, text=True,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
            outputs = [proc.communicate(timeout=120)[0] for proc in procs]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    results = []
    for proc, out in zip(procs, outputs):
        assert proc.returncode == 0, out[-3000:]
        line = next(line for line in out.splitlines() if line.startswith("RESULT"))
        fields = line.split(" ", 7)[1:]
        results.append([int(f) for f in fields[:6]] + [json.loads(fields[6])])
    return results


@pytest.mark.spawns
def test_two_horovod_workers_meet_at_the_rendezvous_and_allreduce():
    results = run_horovod_job(["localhost"], 2)
    assert results == [[0, 2, 0, 2, 0, 1, [3.0] * 4],
                       [1, 2, 1, 2, 0, 1, [3.0] * 4]]


# The node label only names the local scope: it must differ between nodes and is never
# resolved (an unresolvable label works), which lets two "nodes" share loopback.
@pytest.mark.parametrize("second_node", [
    socket.gethostname() if socket.gethostname() != "localhost" else "dg-node-1",
    "dg-node-1.invalid",
])
@pytest.mark.spawns
def test_two_nodes_of_two_workers_on_loopback_allreduce_with_local_and_cross_ranks(
        second_node):
    results = run_horovod_job(["localhost", second_node], 2)
    total = [1.0 + 2 + 3 + 4] * 4
    assert results == [[0, 4, 0, 2, 0, 2, total],
                       [1, 4, 1, 2, 0, 2, total],
                       [2, 4, 0, 2, 1, 2, total],
                       [3, 4, 1, 2, 1, 2, total]]
