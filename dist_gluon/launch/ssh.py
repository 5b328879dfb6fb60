"""One command for all hosts: start a node launcher on each host over ssh (the first
host is node 0, the master) and relay their output here."""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time

from . import output, secret
from .config import Host, LaunchConfig
from .processes import Process, terminate

PARENT_ENV = "DG_LAUNCHED_BY"
# What a node launcher needs from this environment on the other hosts (ssh gives a
# bare one); the job's own settings travel too.
_FORWARD = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV", "OMP_NUM_THREADS")
# COVERAGE_: coverage.py's process start-up (COVERAGE_PROCESS_START), so that a
# measured job is measured on every host too
_FORWARD_PREFIXES = ("DG_", "MXNET_", "HOROVOD_", "PS_", "PYTHON", "OMP_", "KMP_", "COVERAGE_")
_NOT_FORWARDED = {"DG_RANK", "DG_LOCAL_RANK", "DG_NUM_WORKERS", "DG_NODE_RANK",
                  "DG_NNODES", "DG_BACKEND", "DG_RESTART", "DG_REFORMATION",
                  "DG_CONTROL_DIR", PARENT_ENV,
                  secret.ENV}     # a command line shows in ps: the secret goes by stdin
END_GRACE = 20.0        # seconds the other node launchers get once one has ended


def parse_hosts(text: str) -> list[Host]:
    """'host1:2,host2:2' -> [Host('host1', 2), Host('host2', 2)] (slots default to 1);
    'host:N:S' also gives the host's number of ps-lite servers ('srv:0:2': a host that
    runs 2 servers and no worker)."""
    hosts = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        host, _, rest = item.partition(":")
        slots, _, servers = rest.partition(":")
        hosts.append(Host(host, _slots(slots or "1", item),
                          _servers(servers, item) if servers else None))
    return _checked(hosts, "-H")


def read_hostfile(path: str) -> list[Host]:
    """Lines 'host slots=N' (or 'host:N', or 'host'), optionally with 'servers=S' (the
    host's ps-lite servers; 'slots=0 servers=S': a host that only serves); '#' starts a
    comment."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as err:
        raise ValueError(f"cannot read --hostfile {path!r}: {err}") from err
    hosts = []
    for number, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        host, slots, servers = words[0], "1", None
        if ":" in host:
            host, slots = host.split(":", 1)
        for word in words[1:]:
            key, _, value = word.partition("=")
            if key not in ("slots", "max_slots", "servers") or not value:
                raise ValueError(f"{path}:{number}: expected 'host slots=N' (and "
                                 f"optionally 'servers=S'), got {line!r}")
            if key == "slots":
                slots = value
            elif key == "servers":
                servers = _servers(value, f"{path}:{number}")
        hosts.append(Host(host, _slots(slots, f"{path}:{number}"), servers))
    return _checked(hosts, f"--hostfile {path}")


def _slots(text: str, where: str) -> int:
    try:
        slots = int(text)
    except ValueError:
        raise ValueError(f"{where}: slots must be a whole number, got {text!r}") from None
    if slots < 0:
        raise ValueError(f"{where}: slots must be at least 1 (0 for a host that only runs "
                         f"ps-lite servers), got {slots}")
    return slots


def _servers(text: str, where: str) -> int:
    try:
        servers = int(text)
    except ValueError:
        raise ValueError(f"{where}: servers must be a whole number, got {text!r}") from None
    if servers < 0:
        raise ValueError(f"{where}: servers must be at least 0, got {servers}")
    return servers


def _checked(hosts: list[Host], where) -> list[Host]:
    if not hosts:
        raise ValueError(f"{where} names no host")
    names = [h.name for h in hosts]
    if len(set(names)) != len(names):
        raise ValueError(f"{where} names a host twice: {names}")
    workers = [h for h in hosts if h.slots > 0]
    if not workers:
        raise ValueError(f"{where}: no host runs workers (every host has 0 slots)")
    if len({h.slots for h in workers}) != 1:
        raise ValueError(f"{where}: every host that runs workers must have the same number "
                         f"of slots (ranks are numbered host by host), got "
                         f"{', '.join(f'{h.name}:{h.slots}' for h in hosts)}")
    return hosts


def _forwarded_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if (k in _FORWARD or k.startswith(_FORWARD_PREFIXES)) and k not in _NOT_FORWARDED}


def node_command(config: LaunchConfig, node_rank: int, master_addr: str) -> str:
    """The shell command that starts node ``node_rank``'s launcher on its host."""
    host = config.host_slots[node_rank]
    nnodes = f"{config.min_nodes}:{config.max_nodes}" if config.elastic \
        else str(len(config.host_slots))
    argv = [sys.executable, "-m", "dist_gluon.launch",
            "--nnodes", nnodes, "--node-rank", str(node_rank),
            "--master-addr", master_addr, "--master-port", str(config.master_port),
            "--join-timeout", f"{config.join_timeout:g}",
            "--heartbeat", f"{config.heartbeat:g}", "--silence-limit", f"{config.silence_limit:g}",
            "-n", str(host.slots), "--backend", config.backend,
            "--servers", str(config.servers if host.servers is None else host.servers),
            "--max-restarts", str(config.max_restarts),
            "--stall-warning", f"{config.stall_warning or 0:g}", "--report", config.report]
    if config.elastic:
        argv += ["--preempt-grace", f"{config.preempt_grace:g}",
                 "--last-call", f"{config.last_call:g}"]
    if not config.warm_standby:
        argv.append("--no-warm-standby")
    if not config.tune:
        argv.append("--no-tune")
    for flag, value in (("--timeout", config.timeout), ("--stall-timeout", config.stall_timeout),
                        ("--iface", config.iface), ("--transport", config.transport),
                        # node 0's mpirun starts the other nodes' MPI ranks over ssh
                        ("--ssh-port", config.ssh_port),
                        ("--ssh-identity-file", config.ssh_identity_file),
                        # node 0's launcher observes the job (observe.py)
                        ("--timeline", config.timeline),
                        ("--report-every", config.report_every)):
        if value is not None:
            argv += [flag, str(value)]
    argv += ["--", *config.command]
    env = dict(_forwarded_env(), **{PARENT_ENV: "ssh"})
    assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))
    return f"cd {shlex.quote(os.getcwd())} && exec env {assignments} {shlex.join(argv)}"


def ssh_argv(config: LaunchConfig, host: str) -> list[str]:
    argv = ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
            "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR"]
    if config.ssh_port is not None:
        argv += ["-p", str(config.ssh_port)]
    if config.ssh_identity_file is not None:
        argv += ["-i", config.ssh_identity_file]
    return argv + [host]


def run(config: LaunchConfig) -> int:
    """Start every host's launcher and wait for them; node 0's exit status wins."""
    master = config.master_addr or config.host_slots[0][0]
    launchers: list[Process] = []
    job_secret = (secret.generate() + "\n").encode()

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for rank, (host, *_) in enumerate(config.host_slots):
            argv = ssh_argv(config, host) + [node_command(config, rank, master)]
            # stdin stays open: the node launcher ends when this process goes away
            launchers.append(Process("", "launcher", rank, argv, None, stdin=subprocess.PIPE))
            try:
                launchers[-1].popen.stdin.write(job_secret)    # its first line
                launchers[-1].popen.stdin.flush()
            except OSError:
                pass        # ssh already failed; its exit status says so
        ended_at = None
        while True:
            codes = [p.returncode for p in launchers]
            if all(c is not None for c in codes):
                break
            # an elastic job goes on without a host whose launcher ended; node 0's ends it
            ended = codes[0] is not None if config.elastic \
                else any(c is not None for c in codes)
            if ended_at is None and ended:
                ended_at = time.monotonic()
            if ended_at is not None and time.monotonic() - ended_at > END_GRACE:
                stuck = [config.host_slots[i][0] for i, c in enumerate(codes) if c is None]
                output.emit(f"dist_gluon.launch: the launchers on {', '.join(stuck)} "
                            "did not end; closing their ssh sessions\n")
                break
            time.sleep(0.1)
        codes = [p.returncode for p in launchers]
        if config.elastic and codes[0] != 255:
            # the job went on without those hosts; node 0's launcher said why
            gone = [config.host_slots[i][0] for i, c in enumerate(codes) if c == 255]
            if gone:
                output.emit(f"dist_gluon.launch: the ssh session to {', '.join(gone)} "
                            "ended (exit 255) while the elastic job ran\n")
        elif codes[0] == 255 or any(c == 255 for c in codes):
            bad = [config.host_slots[i][0] for i, c in enumerate(codes) if c == 255]
            output.emit(f"dist_gluon.launch: ssh to {', '.join(bad)} failed (exit 255):"
                        " check that passwordless ssh works (--ssh-port, "
                        "--ssh-identity-file) and that dist_gluon is installed there "
                        "at the same path\n")
        if codes[0] not in (None, 0) or config.elastic:
            return 1 if codes[0] is None else codes[0]
        return next((c for c in codes if c not in (None, 0)), 0 if None not in codes else 1)
    except KeyboardInterrupt:
        output.emit("dist_gluon.launch: interrupted; ending the job on every host\n")
        return 130
    finally:
        for p in launchers:
            if p.popen.stdin:
                try:
                    p.popen.stdin.close()
                except OSError:
                    pass
        limit = time.monotonic() + 10
        while any(p.returncode is None for p in launchers) and time.monotonic() < limit:
            time.sleep(0.1)
        terminate(launchers)
        for s, handler in previous.items():
            signal.signal(s, handler)
