"""Only a job's own launchers and workers get in: the launchers' channel authenticates
every message with the job secret (an HMAC over a per-connection challenge, the joining
side's nonce and a sequence number), and the Gloo rendezvous serves only requests that
carry the job's token. Strangers are dropped, logged with their address, and the job
goes on."""
from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from conftest import assert_ok, launch, process_env, worker_lines
from dist_gluon.launch import channel, secret
from dist_gluon.launch.rendezvous import GlooRendezvous

SECRET = "the job's secret"
HELLO = {"type": "hello", "node": 1, "host": "node1", "nproc": 1}


# ---------------------------------------------------------------------- the messages
def _pair(node_secret=SECRET, master_secret=SECRET, challenge="c0ffee"):
    """A node's seal and node 0's seal of one connection, after the hello."""
    node = channel._Seal(node_secret, challenge, "n")
    master = channel._Seal(master_secret, challenge, "m")
    hello = node.seal_hello(dict(HELLO, nonce="n0nce"))
    return node, master, hello


def test_signed_messages_go_both_ways_in_order():
    node, master, hello = _pair()
    assert master.open(hello)["node"] == 1
    assert master.open(node.seal({"type": "status", "states": []}))["type"] == "status"
    assert node.open(master.seal({"type": "start", "spec": {"nnodes": 2}}))["spec"] == \
        {"nnodes": 2}
    assert node.open(master.seal({"type": "tick"})) == {"type": "tick"}


def test_a_hello_made_with_another_secret_is_refused_naming_the_node_it_claims():
    _, master, hello = _pair(node_secret="another secret")
    with pytest.raises(channel.Refused, match="it says it is node 1's launcher but its "
                       "hello does not authenticate with this job's secret: a launcher "
                       "given a different DG_JOB_SECRET or --job-secret-file"):
        master.open(hello)


def test_an_unsigned_hello_and_garbage_are_refused():
    master = channel._Seal(SECRET, "c0ffee", "m")
    with pytest.raises(channel.Refused, match="node 1's launcher but its hello is not "
                                              "signed at all"):
        master.open(json.dumps(HELLO).encode() + b"\n")
    for garbage in (b"\x00\xff\xfe garbage\n", b"a" * 64 + b" {not json\n", b"\n",
                    b"[" * 50000 + b"\n"):
        with pytest.raises(channel.Refused):
            channel._Seal(SECRET, "c0ffee", "m").open(garbage)


def test_a_tampered_message_is_refused():
    node, master, hello = _pair()
    master.open(hello)
    line = node.seal({"type": "status", "states": [], "service_failure": None})
    tampered = line.replace(b'"service_failure": null', b'"service_failure": "boom"')
    assert tampered != line
    with pytest.raises(channel.Refused, match="message 1 does not authenticate"):
        master.open(tampered)


def test_a_replayed_message_is_refused_on_its_own_connection_and_on_another():
    node, master, hello = _pair()
    master.open(hello)
    status = node.seal({"type": "status", "states": []})
    master.open(status)
    with pytest.raises(channel.Refused, match="message 2 does not authenticate"):
        master.open(status)             # the same line again
    other = channel._Seal(SECRET, "another challenge", "m")
    with pytest.raises(channel.Refused, match="node 1's launcher"):
        other.open(hello)               # a captured hello, on a new connection
    # node 0's messages cannot be turned back at node 0, nor sent to another node
    start = master.seal({"type": "start", "spec": {}})
    with pytest.raises(channel.Refused):
        master.open(start)
    node2 = channel._Seal(SECRET, "c0ffee", "n")
    node2.seal_hello(dict(HELLO, nonce="other nonce"))
    with pytest.raises(channel.Refused):
        node2.open(start)


# ---------------------------------------------------------------------- the join
def _capture_hello(secret_text: str, retried: bool = False) -> bytes:
    """The hello line that a real node-1 launcher of the job sends to whoever challenges
    it (here a fake node 0, which hangs up without welcoming it). With ``retried``, check
    that the launcher joins again, then ends at --join-timeout saying why."""
    fake = socket.create_server(("127.0.0.1", 0))
    fake.settimeout(60)
    port = fake.getsockname()[1]
    argv = [sys.executable, "-m", "dist_gluon.launch", "--nnodes", "2", "--node-rank", "1",
            "--master-addr", "127.0.0.1", "--master-port", str(port), "-n", "1",
            "--backend", "dist_sync", "--join-timeout", "2", "--", "true"]
    env = process_env(**{secret.ENV: secret_text})
    launcher = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    try:
        hellos = []
        for _ in range(2 if retried else 1):    # the first join, and the one tried again
            sock, _ = fake.accept()
            sock.sendall(b'{"dist_gluon": "launcher", "challenge": "beef"}\n')
            hellos.append(sock.makefile("rb").readline())
            sock.close()
        fake.close()
        if not retried:
            launcher.kill()
        _, err = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
        fake.close()
    first = json.loads(hellos[0].split(b" ", 1)[1])
    assert first["node"] == 1
    if retried:
        assert launcher.returncode == 1, err
        assert f"not admitted yet: the job's host at 127.0.0.1:{port} closed the " \
               "connection before it took this node in" in err, err
        assert f"cannot reach the master launcher at 127.0.0.1:{port} within " \
               "--join-timeout 2 s" in err, err
        assert "lost the master launcher" not in err, err
        again = json.loads(hellos[1].split(b" ", 1)[1])
        assert again["node"] == 1 and again["nonce"] != first["nonce"]
    return hellos[0]


def _intruders(port: int, replay: bytes) -> dict[str, int]:
    """Connect to node 0's launcher as strangers would; the local port of each."""
    ports = {}

    def connect():
        sock = _connect(port)
        challenge = sock.makefile("rb").readline()
        assert json.loads(challenge)["dist_gluon"] == "launcher"
        return sock

    sock = connect()
    ports["plain hello"] = sock.getsockname()[1]
    sock.sendall(json.dumps(HELLO).encode() + b"\n")
    assert json.loads(sock.makefile("rb").readline()) == {"refused": "hello"}
    sock.close()
    sock = connect()
    ports["replay"] = sock.getsockname()[1]
    sock.sendall(replay)
    assert json.loads(sock.makefile("rb").readline()) == {"refused": "hello"}
    sock.close()
    sock = connect()
    ports["garbage"] = sock.getsockname()[1]
    sock.sendall(os.urandom(300).replace(b"\n", b"") + b"\n")
    sock.makefile("rb").readline()
    sock.close()
    sock = connect()
    ports["huge line"] = sock.getsockname()[1]
    try:
        sock.sendall(b"x" * (10 << 20) + b"\n")
    except OSError:
        pass                            # dropped while it was still sending
    sock.close()
    return ports


def test_strangers_are_refused_and_logged_and_the_real_node_joins():
    port = _free_port()
    said, result = [], {}

    def master():
        result["joined"] = channel.accept_nodes(port, 2, 60, said.append, SECRET,
                                                "127.0.0.1")

    thread = threading.Thread(target=master)
    thread.start()
    squatter = _connect(port)           # says nothing
    ports = _intruders(port, _capture_hello(SECRET, retried=True))
    link = channel.connect_to_master("127.0.0.1", port, dict(HELLO, host="real-node-1"),
                                     30, SECRET)
    thread.join(60)
    joined = result["joined"]
    assert list(joined) == [1] and joined[1][1]["host"] == "real-node-1"
    node_side, (master_side, _) = link, joined[1]
    assert node_side.receive(timeout=30) == {"type": "welcome", "waiting": False}
    master_side.send({"type": "start", "spec": {"restart": 0}})
    assert node_side.receive(timeout=30) == {"type": "start", "spec": {"restart": 0}}
    node_side.send({"type": "stopped"})
    assert master_side.receive(timeout=30) == {"type": "stopped"}
    _assert_refused(said, ports)
    assert said[-1] == "node 1 (real-node-1) joined (2 of 2 nodes)"
    squatter.close()
    link.close(flush=0)
    master_side.close(flush=0)


def _assert_refused(said: list[str], ports: dict[str, int]) -> None:
    """Each intruder's connection was refused, logged with its address and reason."""
    for what, reason in (("plain hello", "node 1's launcher but its hello is not signed"),
                         ("replay", "node 1's launcher but its hello does not "
                                    "authenticate with this job's secret"),
                         ("garbage", "not a signed dist_gluon message"),
                         ("huge line", "a line longer than 65536 bytes")):
        line = next((s for s in said if f" 127.0.0.1:{ports[what]}: " in s), None)
        assert line is not None, f"{what} not logged:\n" + "\n".join(said)
        assert f"refused the connection from 127.0.0.1:{ports[what]}: it " in line, line
        assert reason in line and line.endswith("carrying on"), line


def _connect(port: int) -> socket.socket:
    """A connection to node 0's launcher, once it listens."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=30)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.spawns
def test_a_node_with_another_secret_hears_why_it_was_refused():
    port = _free_port()
    said, result = [], {}
    thread = threading.Thread(target=lambda: result.update(error=_join_error(port, said)))
    thread.start()
    link = channel.connect_to_master("127.0.0.1", port, HELLO, 30, "not the job's secret")
    assert link.receive(timeout=30) is None
    assert link.refusal == (
        f"node 0's launcher at 127.0.0.1:{port} refused this launcher: its hello does not "
        "authenticate with node 0's job secret; give every node the same DG_JOB_SECRET "
        "or --job-secret-file")
    thread.join(60)
    assert "node rank 1 never joined within --join-timeout 3 s" in result["error"]
    assert "it says it is node 1's launcher but its hello does not authenticate" in said[0]


def _join_error(port, said) -> str:
    try:
        channel.accept_nodes(port, 2, 3, said.append, SECRET, "127.0.0.1")
    except channel.JoinError as err:
        return str(err)
    return "joined"


def test_node_0_listens_on_the_master_address_when_it_is_its_own():
    assert channel.listen_address("127.0.0.1") == "127.0.0.1"
    assert channel.listen_address(None) == ""
    assert channel.listen_address("192.0.2.1") == ""        # not this machine's
    assert channel.listen_address("no-such-host.invalid") == ""


# ---------------------------------------------------------------------- the secret
def test_a_job_of_several_nodes_without_a_secret_is_a_usage_error(tmp_path):
    env = process_env()
    env.pop(secret.ENV, None)
    argv = [sys.executable, "-m", "dist_gluon.launch", "--nnodes", "2", "--node-rank", "1",
            "--master-addr", "127.0.0.1", "-n", "1", "--", "true"]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "a job of 2 nodes needs a job secret" in proc.stderr
    assert "export DG_JOB_SECRET=$(python -c 'import secrets; print(secrets.token_hex(32))')" \
        in proc.stderr
    missing = tmp_path / "missing"
    proc = subprocess.run(argv[:-2] + ["--job-secret-file", str(missing), "--", "true"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert f"cannot read --job-secret-file {str(missing)!r}" in proc.stderr


def test_the_secret_comes_from_the_file_else_the_environment():
    assert secret.for_node(None, {secret.ENV: " s3cret\n"}, 2) == "s3cret"
    single = secret.for_node(None, {}, 1)
    assert len(single) == 64 and single != secret.for_node(None, {}, 1)
    with pytest.raises(ValueError, match="is empty"):
        secret.for_node(None, {secret.ENV: ""}, 2)


# ---------------------------------------------------------------------- the rendezvous
def _request(port, method, path, body=b""):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request(method, path, body=body)
    response = conn.getresponse()
    status, data = response.status, response.read()
    conn.close()
    return status, data


def test_the_rendezvous_serves_only_requests_with_the_job_token():
    said = []
    with GlooRendezvous("127.0.0.1", 0, token="t0ken", on_refused=said.append) as server:
        port = server.port
        # what horovod's client sends, given ADDR = <addr>:<port>/t0ken
        assert _request(port, "PUT", f"/t0ken:{port}/global/0", b"addr0")[0] == 200
        assert _request(port, "GET", f"/t0ken:{port}/global/0") == (200, b"addr0")
        assert _request(port, "GET", "/global/0")[0] == 403
        assert _request(port, "PUT", f"/wrong:{port}/global/0", b"evil")[0] == 403
        assert _request(port, "DELETE", f"/t0kex:{port}/global/0")[0] == 403
        assert _request(port, "GET", f"/t0ken:{port}/global/0") == (200, b"addr0")
        assert server.keys("global") == ["0"]
    assert said == ["the Gloo rendezvous refused a GET request from 127.0.0.1 without "
                    "this job's token (further ones from there are refused silently); "
                    "carrying on"]


def test_workers_get_the_token_in_the_address_that_horovod_puts_in_every_url():
    from dist_gluon.launch.jobenv import horovod_worker_env
    env = horovod_worker_env("10.0.0.1", 29500, "eth0", "node1", 0, 2, 0, 1, 0, 2,
                             rendezvous_token="ab12")
    assert env["HOROVOD_GLOO_RENDEZVOUS_ADDR"] == "10.0.0.1:29500/ab12"
    # horovod: url = "http://" + ADDR + ":" + PORT + "/" + scope + "/" + key
    url = "http://" + env["HOROVOD_GLOO_RENDEZVOUS_ADDR"] + ":" + \
        env["HOROVOD_GLOO_RENDEZVOUS_PORT"] + "/global/rank_0"
    assert url == "http://10.0.0.1:29500/ab12:29500/global/rank_0"
    token = secret.rendezvous_token("s", {"restart": 0, "rendezvous_port": 1})
    assert token != secret.rendezvous_token("s", {"restart": 1, "rendezvous_port": 1})
    assert token != secret.rendezvous_token("t", {"restart": 0, "rendezvous_port": 1})
    assert len(token) == 32 and token.isalnum()


# ---------------------------------------------------------------------- through the launcher
SUM_WORKER = """
import mxnet as mx
import dist_gluon as dg

kv = dg.create()
out = mx.nd.zeros(3)
kv.pushpull("x", mx.nd.full((3,), kv.rank + 1.0), out)
print("SUM", out.asnumpy().tolist(), flush=True)
"""


def _node_launcher(rank: int, port: int, script, cwd, job_secret: str, *extra):
    argv = [sys.executable, "-m", "dist_gluon.launch", "--nnodes", "2", "--node-rank",
            str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port), "-n", "1",
            "--backend", "dist_sync", *extra, "--", sys.executable, str(script)]
    env = process_env(**{secret.ENV: job_secret})
    return subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_a_job_completes_with_its_own_node_1_whatever_strangers_send_first(tmp_path):
    script = tmp_path / "sum.py"
    script.write_text(SUM_WORKER)
    port = _free_port()
    replay = _capture_hello("launcher test secret")
    node0 = _node_launcher(0, port, script, tmp_path, "launcher test secret")
    node1 = squatter = None
    try:
        squatter = _connect(port)       # connects first and says nothing
        ports = _intruders(port, replay)
        node1 = _node_launcher(1, port, script, tmp_path, "launcher test secret")
        out1, err1 = node1.communicate(timeout=240)
        out0, err0 = node0.communicate(timeout=240)
    finally:
        for proc in (node0, node1):
            if proc is not None:
                proc.kill()
        if squatter is not None:
            squatter.close()
    report = f"--- node 0\n{out0}{err0}\n--- node 1\n{out1}{err1}"
    assert node0.returncode == 0 and node1.returncode == 0, report
    assert worker_lines(out0, 0) == ["SUM [3.0, 3.0, 3.0]"], report
    assert worker_lines(out1, 1) == ["SUM [3.0, 3.0, 3.0]"], report
    prefix = "dist_gluon.launch[node 0]: "
    said = [line[len(prefix):] for line in err0.splitlines() if line.startswith(prefix)]
    _assert_refused(said, ports)
    assert f"{prefix}node 1 (" in err0 and "joined (2 of 2 nodes)" in err0, report


def test_nodes_with_different_secrets_say_which_secret_to_check(tmp_path):
    port = _free_port()
    secret_file = tmp_path / "job.secret"
    secret_file.write_text("node 0's secret\n")
    node0 = _node_launcher(0, port, "x.py", tmp_path, "ignored: the file comes first",
                           "--job-secret-file", str(secret_file), "--join-timeout", "20")
    try:
        _connect(port).close()
        node1 = _node_launcher(1, port, "x.py", tmp_path, "node 1's secret")
        _, err1 = node1.communicate(timeout=60)
        node0.terminate()               # it would wait for the real node 1 until 20 s
        _, err0 = node0.communicate(timeout=60)
    finally:
        node0.kill()
    assert node1.returncode == 1
    assert (f"dist_gluon.launch[node 1]: node 0's launcher at 127.0.0.1:{port} refused this "
            "launcher: its hello does not authenticate with node 0's job secret; give every "
            "node the same DG_JOB_SECRET or --job-secret-file") in err1
    assert ("it says it is node 1's launcher but its hello does not authenticate with this "
            "job's secret: a launcher given a different DG_JOB_SECRET or --job-secret-file "
            "than node 0's (give every node the same one)") in err0


RENDEZVOUS_WORKER = """
import http.client
import os

import mxnet as mx
import dist_gluon as dg

kv = dg.create()
addr, token = os.environ["HOROVOD_GLOO_RENDEZVOUS_ADDR"].split("/")
host, port = addr.split(":")
for path in ("/global/rank_0", f"/{token}:{port}/global/rank_0"):
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("GET", path)
    status = conn.getresponse().status     # 404: served, but the key is gone
    print("GET", "with token" if token in path else "without token",
          "served" if status in (200, 404) else status, flush=True)
out = mx.nd.zeros(2)
kv.pushpull("x", mx.nd.full((2,), kv.rank + 1.0), out)
print("SUM", out.asnumpy().tolist(), flush=True)
"""


@pytest.mark.spawns
def test_the_rendezvous_of_a_launched_job_refuses_requests_without_its_token(tmp_path):
    proc = launch(RENDEZVOUS_WORKER, tmp_path, backend="horovod", n=2)
    assert_ok(proc)
    for rank in (0, 1):
        assert worker_lines(proc.stdout, rank) == [
            "GET without token 403", "GET with token served", "SUM [3.0, 3.0]"], proc.stdout
    assert ("dist_gluon.launch: the Gloo rendezvous refused a GET request from 127.0.0.1 "
            "without this job's token") in proc.stderr


def test_over_ssh_the_secret_never_travels_on_a_command_line(monkeypatch):
    from dist_gluon import launch as launch_module
    from dist_gluon.launch import ssh
    monkeypatch.setenv(secret.ENV, "visible-in-ps-if-forwarded")
    args = launch_module._parse_args(["-H", "h1:1,h2:1", "--", "python", "x.py"])
    for rank in (0, 1):
        command = ssh.node_command(args, rank, "h1")
        assert "visible-in-ps-if-forwarded" not in command and secret.ENV not in command
        assert f"{ssh.PARENT_ENV}=ssh" in command     # so it reads the secret from stdin
