"""The emulated cluster (tools/emulated_cluster.py): its hosts behave like separate
machines on one network, and nothing of it outlives its owner."""
from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parent.parent / "tools"
sys.path.insert(0, str(TOOLS))

import emulated_cluster  # noqa: E402
from emulated_cluster import EmulatedCluster, skip_reason  # noqa: E402

needs_root = pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))
PY = sys.executable

RECEIVER = """
import json, socket, sys, threading, time
address, port, senders = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
server = socket.create_server((address, port))
print("ready", flush=True)
counts, threads, start = [], [], None
def drain(conn):
    n = 0
    while chunk := conn.recv(1 << 16):
        n += len(chunk)
    counts.append(n)
    conn.close()
for _ in range(senders):
    conn = server.accept()[0]
    start = start or time.monotonic()
    threads.append(threading.Thread(target=drain, args=(conn,)))
    threads[-1].start()
for thread in threads:
    thread.join()
print(json.dumps({"bytes": sum(counts), "seconds": time.monotonic() - start}))
"""

SENDER = """
import socket, sys
conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
conn.sendall(b"x" * int(sys.argv[3]))
conn.shutdown(socket.SHUT_WR)
conn.recv(1)
"""


def leftovers(tag: str) -> list[str]:
    """Every namespace, interface, hosts file, mount and state file named with ``tag``."""
    found = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    found += subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    found += " ".join(os.listdir("/etc/netns")) if os.path.isdir("/etc/netns") else ""
    found += Path("/proc/mounts").read_text()
    found += " ".join(os.listdir(emulated_cluster.STATE_ROOT))
    return [line for line in found.splitlines() if tag in line]


@pytest.fixture(scope="module")
def cluster():
    with EmulatedCluster(num_hosts=2, sshd=skip_reason(sshd=True) is None) as running:
        yield running


def receive(cluster, host: int, port: int, senders: int) -> subprocess.Popen:
    receiver = cluster.popen(host, [PY, "-c", RECEIVER, cluster.hosts[host].address,
                                    str(port), str(senders)],
                             stdout=subprocess.PIPE, text=True)
    assert receiver.stdout.readline() == "ready\n"
    return receiver


def send(cluster, host: int, to: int, port: int, size: int) -> subprocess.Popen:
    return cluster.popen(host, [PY, "-c", SENDER, cluster.hosts[to].name, str(port),
                                str(size)])


def test_constructor_rejects_bad_arguments_naming_them():
    with pytest.raises(ValueError, match="num_hosts"):
        EmulatedCluster(num_hosts=0)
    with pytest.raises(ValueError, match="rate"):
        EmulatedCluster(num_hosts=2, rate="fast")


@needs_root
def test_each_host_reports_its_own_host_name(cluster):
    for host in cluster.hosts:
        out = cluster.run(host.index, ["sh", "-c", "hostname; " + PY +
                                       " -c 'import socket; print(socket.gethostname())'"],
                          capture_output=True, text=True, check=True).stdout
        assert out.split() == [host.name, host.name]


@needs_root
def test_every_host_name_resolves_to_that_hosts_own_address_never_loopback(cluster):
    names = [host.name for host in cluster.hosts]
    for host in cluster.hosts:
        resolved = cluster.run(host.index, [PY, "-c", "import socket, sys; print(*(socket."
                                            "gethostbyname(n) for n in sys.argv[1:]))", *names],
                               capture_output=True, text=True, check=True).stdout.split()
        assert resolved == [h.address for h in cluster.hosts]
        assert not any(address.startswith("127.") for address in resolved)
    getent = cluster.run(0, ["getent", "hosts", cluster.hosts[1].name], capture_output=True,
                         text=True, check=True).stdout.split()
    assert getent == [cluster.hosts[1].address, cluster.hosts[1].name]


@needs_root
def test_a_tcp_connection_from_host_0_reaches_a_server_on_host_1(cluster):
    receiver = receive(cluster, host=1, port=5101, senders=1)
    send(cluster, host=0, to=1, port=5101, size=100_000).wait(timeout=10)
    assert json.loads(receiver.communicate(timeout=10)[0])["bytes"] == 100_000


@needs_root
def test_the_rate_limits_what_each_host_sends_and_receives():
    rate, size = 20e6, 5_000_000
    theory = size * 8 / rate   # 2 s
    with EmulatedCluster(num_hosts=3, rate="20mbit") as limited:
        receiver = receive(limited, host=1, port=5102, senders=1)
        send(limited, host=0, to=1, port=5102, size=size)
        one_to_one = json.loads(receiver.communicate(timeout=30)[0])
        # Two senders into one host share that host's rate (its ingress is limited too).
        receiver = receive(limited, host=0, port=5103, senders=2)
        send(limited, host=1, to=0, port=5103, size=size // 2)
        send(limited, host=2, to=0, port=5103, size=size // 2)
        two_to_one = json.loads(receiver.communicate(timeout=30)[0])
    for transfer in one_to_one, two_to_one:
        assert transfer["bytes"] == size
        assert transfer["seconds"] >= 0.6 * theory, transfer


REACH = """
import socket, sys
conn = socket.socket()
conn.settimeout(1.0)
try:
    conn.connect((sys.argv[1], 9))
    print("reached")
except ConnectionRefusedError:     # the host answered: nothing listens on port 9
    print("reached")
except TimeoutError:
    print("cut")
"""


def reachable(cluster) -> set[tuple[int, int]]:
    """Which (from, to) pairs of hosts reach each other."""
    return {(i, j) for i in range(len(cluster.hosts)) for j in range(len(cluster.hosts))
            if i != j and cluster.run(i, [PY, "-c", REACH, cluster.hosts[j].address],
                                      capture_output=True, text=True).stdout == "reached\n"}


@needs_root
def test_a_partition_drops_what_crosses_it_both_ways_and_heal_undoes_it():
    with EmulatedCluster(num_hosts=4, rate="1gbit") as c:
        every = {(i, j) for i in range(4) for j in range(4) if i != j}
        c.partition([0, 1], [2, 3])
        assert reachable(c) == {(0, 1), (1, 0), (2, 3), (3, 2)}
        c.heal()
        c.cut(0, 1)                      # one link only
        assert reachable(c) == every - {(0, 1), (1, 0)}
        c.heal()
        c.partition([0], [1, 2, 3])
        assert reachable(c) == every - {(0, j) for j in (1, 2, 3)} - \
            {(j, 0) for j in (1, 2, 3)}
        c.heal()
        assert reachable(c) == every
        with pytest.raises(ValueError, match="host 1 is in two groups"):
            c.partition([0, 1], [1, 2])
        # host 1's ingress limit (now under the class that passes packets) still holds:
        # two senders of 50 MB share its 1 Gbit/s, 0.8 s at least
        receiver = receive(c, host=1, port=5104, senders=2)
        for sender in (0, 2):
            send(c, host=sender, to=1, port=5104, size=50_000_000)
        moved = json.loads(receiver.communicate(timeout=60)[0])
        assert moved["bytes"] == 100_000_000 and moved["seconds"] >= 0.6 * 0.8, moved


@needs_root
def test_ssh_from_host_0_runs_commands_on_each_host_with_sshds_environment(cluster):
    if not cluster.sshd:
        pytest.skip(skip_reason(sshd=True))
    for host in cluster.hosts:
        resolve = f"import socket; print(socket.gethostbyname({cluster.hosts[0].name!r}))"
        remote = f"hostname; echo ${{DG_PROBE:-unset}}; {PY} -c {shlex.quote(resolve)}"
        out = cluster.run(0, cluster.ssh_argv(host.index) + [remote], capture_output=True,
                          text=True, timeout=30, env=dict(os.environ, DG_PROBE="set"))
        assert out.returncode == 0, out.stderr
        # The session sees its host's name and hosts file, but not the client's
        # environment: a launcher passes absolute paths and variables explicitly.
        assert out.stdout.split() == [host.name, "unset", cluster.hosts[0].address]


@needs_root
@pytest.mark.parametrize("how", ["normal exit", "exception"])
def test_nothing_is_left_after_the_with_block(how):
    with pytest.raises(KeyError) if how == "exception" else contextlib.nullcontext():
        with EmulatedCluster(num_hosts=2, sshd=skip_reason(sshd=True) is None) as running:
            tag = running.tag
            sleeper = running.popen(1, ["sleep", "600"])
            assert leftovers(tag)
            if how == "exception":
                raise KeyError("boom")
    assert leftovers(tag) == []
    assert sleeper.poll() is not None


OWNER = """
import subprocess, sys, time
sys.path.insert(0, {tools!r})
from emulated_cluster import EmulatedCluster
with EmulatedCluster(num_hosts=2) as cluster:
    cluster.popen(0, ["sleep", "600"])
    print(cluster.tag, flush=True)
    time.sleep(600)
"""


def start_owner() -> tuple[subprocess.Popen, str]:
    owner = subprocess.Popen([PY, "-c", OWNER.format(tools=str(TOOLS))],
                             stdout=subprocess.PIPE, text=True)
    return owner, owner.stdout.readline().strip()


@needs_root
def test_sigterm_of_the_owner_tears_the_cluster_down():
    owner, tag = start_owner()
    assert leftovers(tag)
    owner.send_signal(signal.SIGTERM)
    assert owner.wait(timeout=20) == -signal.SIGTERM
    assert leftovers(tag) == []


@needs_root
def test_down_removes_a_cluster_whose_owner_was_killed():
    owner, tag = start_owner()
    owner.kill()
    owner.wait(timeout=10)
    assert leftovers(tag)
    down = subprocess.run([PY, str(TOOLS / "emulated_cluster.py"), "down"],
                          capture_output=True, text=True, timeout=30)
    assert down.returncode == 0, down.stderr
    # (A concurrent run's start-up may have removed it first: down then says "nothing".)
    assert leftovers(tag) == []


def test_without_root_the_cluster_says_it_needs_root():
    system_python = "/usr/bin/python3"   # the venv's interpreter lives in root's home
    if os.geteuid() != 0 or not os.access(system_python, os.X_OK):
        pytest.skip("needs root (to drop to nobody) and /usr/bin/python3")
    # the module's source comes on stdin: nobody may not be able to read the checkout
    # (a clone in a mktemp directory is root's alone)
    script = textwrap.dedent("""
        import sys
        import types
        module = sys.modules["emulated_cluster"] = types.ModuleType("emulated_cluster")
        exec(compile(sys.stdin.read(), "emulated_cluster.py", "exec"), module.__dict__)
        print(module.skip_reason())
        try:
            module.EmulatedCluster(num_hosts=2).__enter__()
        except RuntimeError as error:
            print(error)
        """)
    out = subprocess.run([system_python, "-c", script], capture_output=True, text=True,
                         input=(TOOLS / "emulated_cluster.py").read_text(), cwd="/",
                         preexec_fn=lambda: os.setuid(65534), timeout=30)
    assert out.stdout.splitlines() == [
        "needs root to create network namespaces",
        "cannot create an emulated cluster: needs root to create network namespaces"], out


def test_the_tool_imports_neither_mxnet_nor_horovod_nor_dist_gluon():
    script = (f"import sys; sys.path.insert(0, {str(TOOLS)!r}); import emulated_cluster; "
              "print(sorted({'mxnet', 'horovod', 'dist_gluon'} & set(sys.modules)))")
    started = time.monotonic()
    out = subprocess.run([PY, "-c", script], capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "[]", out.stderr
    assert time.monotonic() - started < 5
