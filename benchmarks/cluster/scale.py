"""Part 9 of ``make bench-cluster``: the launchers' control plane against the number of
nodes, 4 to 256 emulated hosts, each with one launcher and one light worker (a shell
loop: no MXNet, so the shared cores time the launchers alone).

For every size, a static job (``--nnodes N``) and an elastic one (``--nnodes 2:N``), all
launchers started at once as ``srun`` starts them (node 0 first, then the others in
order, in one loop):

- formation: from the first launcher's start to the last worker's start;
- steady state: over ``STEADY`` seconds of the running round, node 0's launcher's CPU
  and the bytes its link carries each way per second, and every launcher's CPU per node;
- re-formation: the static job loses a worker (SIGKILL; --max-restarts 1 restarts every
  node): from the kill to the last worker of the next round started; the elastic job
  loses a node (every process of its host SIGKILLed): from the kill to the last of the
  N-1 survivors' workers started in the re-formed round.

The report goes to ``benchmarks/RESULTS-cluster-scale.md``, the raw numbers to
``benchmarks/results-cluster-scale.json``: files of this part alone, so that reruns of
other parts never overwrite them.
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(REPO))      # this checkout's launcher, as the jobs' PYTHONPATH
import emulated_cluster  # noqa: E402

from dist_gluon.launch import channel  # noqa: E402
from dist_gluon.launch.protocol import RoundSpec, Start  # noqa: E402

SIZES = (4, 16, 64, 128, 256)
QUICK_SIZES = (4, 16)
STEADY = 10.0               # seconds of the running round measured
TARGETS = {"form": 30.0, "reform": 3.0}     # at 256 nodes, on this 2-core machine
CLK_TCK = os.sysconf("SC_CLK_TCK")
# the light worker: says when it started (restart, re-formation, rank, pid, time), then
# waits, taking no CPU, until the benchmark opens the FIFO ``finish`` for writing
WORKER = ('echo "$DG_RESTART $DG_REFORMATION $DG_RANK $$ $(date +%s.%N)" >> {dir}/starts; '
          'read _ < {dir}/finish; exit 0')


def _cpu(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` so far; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def _link_bytes(host) -> tuple[int, int]:
    """Bytes host ``host`` sent and received so far (its veth's far end in this
    namespace counts them the other way round)."""
    stats = Path("/sys/class/net") / host.name / "statistics"
    return int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text())


def _starts(directory: Path) -> list[tuple[int, int, int, int, float]]:
    try:
        text = (directory / "starts").read_text()
    except OSError:
        return []
    rows = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 5:
            rows.append((int(parts[0]), int(parts[1]), int(parts[2]), int(parts[3]),
                         float(parts[4])))
    return rows


def _wait_starts(directory: Path, count: int, restart: int, deadline: float,
                 procs) -> list | None:
    """The start lines of round ``restart`` once ``count`` workers have started;
    None when the job ends or the deadline passes first."""
    while time.monotonic() < deadline:
        rows = [r for r in _starts(directory) if r[0] == restart]
        if len(rows) >= count:
            return rows
        if procs[0].poll() is not None:
            return None
        time.sleep(0.05)
    return None


def _kill_host(cluster, host: int) -> None:
    """SIGKILL every process on the host (its launcher and worker)."""
    inode = os.stat(f"/run/netns/{cluster.hosts[host].namespace}").st_ino
    for entry in os.scandir("/proc"):
        try:
            if entry.name.isdigit() and os.stat(f"/proc/{entry.name}/ns/net").st_ino == inode:
                os.kill(int(entry.name), signal.SIGKILL)
        except OSError:
            pass


def run_job(cluster, elastic: bool, workdir: Path, timeout: float, log) -> dict:
    """One job on every host of ``cluster``: its formation, steady state and
    re-formation, measured."""
    nodes = cluster.num_hosts
    mode = "elastic" if elastic else "static"
    directory = workdir / f"{mode}-{nodes}"
    directory.mkdir()
    os.mkfifo(directory / "finish")
    port = "29400" if elastic else "29401"
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/root",
           "PYTHONPATH": str(REPO),
           "DG_JOB_SECRET": f"scale-{mode}-{nodes}", "LANG": "C.UTF-8"}
    worker = ["/bin/sh", "-c", WORKER.format(dir=shlex.quote(str(directory)))]
    result = {"nodes": nodes, "mode": mode, "load_start": os.getloadavg()}
    procs = []
    started = time.time()
    began = time.monotonic()
    said = []           # node 0's lines, stamped as they are read
    for host in cluster.hosts:
        argv = [sys.executable, "-m", "dist_gluon.launch",
                "--nnodes", f"2:{nodes}" if elastic else str(nodes),
                "--node-rank", str(host.index), "--master-addr", cluster.hosts[0].address,
                "--master-port", port, "-n", "1", "--backend", "horovod",
                "--max-restarts", "1", "--join-timeout", str(timeout), "--", *worker]
        with open(directory / f"node{host.index}.log", "w") as out:
            procs.append(cluster.popen(host.index, argv, env=env, cwd=directory,
                                       stdin=subprocess.DEVNULL,
                                       stdout=subprocess.PIPE if host.index == 0 else out,
                                       stderr=subprocess.STDOUT, text=True))
        if host.index == 0:
            threading.Thread(target=_stamp, args=(procs[0].stdout, said), daemon=True).start()
    result["spawn_s"] = time.monotonic() - began
    deadline = began + timeout
    try:
        rows = _wait_starts(directory, nodes, 0, deadline, procs)
        if rows is None:
            return _failed(result, said, "the job never started on every node")
        result["form_s"] = max(r[4] for r in rows) - started
        # node 0 sends the round's start: the rest is the nodes starting their workers
        result["form_start_s"] = _said_at(said, ("starting with", f"({nodes} of {nodes}"),
                                          started)
        result.update(_steady(cluster, procs))
        lost = nodes - 1
        fault_at = time.time()
        if elastic:
            _kill_host(cluster, lost)
            survivors, restart = nodes - 1, 1
        else:
            pid = next(r[3] for r in rows if r[2] == lost)
            os.kill(pid, signal.SIGKILL)
            survivors, restart = nodes, 1
        rows = _wait_starts(directory, survivors, restart, time.monotonic() + 120, procs)
        if rows is None:
            return _failed(result, said, "the job never re-formed")
        result["reform_s"] = max(r[4] for r in rows) - fault_at
        # node 0 knows the next round: the rest is ending the old workers and starting
        # the new ones on every node
        result["reform_said_s"] = _said_at(said, ("re-forming with", "restarting the job"),
                                           fault_at)
        result["reform_first_s"] = min(r[4] for r in rows) - fault_at
        _finish(directory)
        codes = [_wait(p, time.monotonic() + 60) for p in procs]
        result["codes_ok"] = all(c == 0 for i, c in enumerate(codes)
                                 if not (elastic and i == lost))
        if not result["codes_ok"]:
            result["error"] = f"exit statuses {sorted(set(codes), key=str)}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        result["load_end"] = os.getloadavg()
    result["node0_said"] = [f"{t - started:.2f} {line}" for t, line in said[-40:]]
    if "reform_s" not in result:
        return result
    log(f"  {mode} {nodes} nodes: formed in {result['form_s']:.1f} s (node 0 started the "
        f"round at {_s(result['form_start_s'])} s), re-formed in {result['reform_s']:.1f} s "
        f"(node 0 knew the next round at {_s(result['reform_said_s'])} s, first worker "
        f"{result['reform_first_s']:.1f} s); node 0 {result['host_cpu']:.3f} CPU s/s, "
        f"{result['host_out_bps'] / 1e3:.0f} kB/s out, {result['host_in_bps'] / 1e3:.0f} "
        f"kB/s in; launchers {1e3 * result['cpu_per_node']:.1f} CPU ms/s per node")
    return result


def _s(seconds: float | None) -> str:
    return "?" if seconds is None else f"{seconds:.1f}"


def _stamp(pipe, said: list) -> None:
    """Node 0's output, each line with the time it was read."""
    for line in pipe:
        said.append((time.time(), line.rstrip("\n")))


def _said_at(said: list, texts: tuple[str, ...], since: float) -> float | None:
    """Seconds from ``since`` to node 0's first line after it holding one of ``texts``."""
    return next((t - since for t, line in list(said)
                 if t >= since and any(text in line for text in texts)), None)


def _steady(cluster, procs) -> dict:
    """Node 0's launcher's CPU and link, every launcher's CPU, over STEADY seconds of
    the running round."""
    time.sleep(1.0)     # the round's first status reports are behind it
    pids = [p.pid for p in procs]
    cpu0 = [_cpu(pid) for pid in pids]
    out0, in0 = _link_bytes(cluster.hosts[0])
    t0 = time.monotonic()
    time.sleep(STEADY)
    seconds = time.monotonic() - t0
    cpu1 = [_cpu(pid) for pid in pids]
    out1, in1 = _link_bytes(cluster.hosts[0])
    agents = sum(b - a for a, b in zip(cpu0[1:], cpu1[1:]))
    return {"host_cpu": (cpu1[0] - cpu0[0]) / seconds,
            "agent_cpu": agents / seconds / max(1, len(pids) - 1),
            "cpu_per_node": (agents + cpu1[0] - cpu0[0]) / seconds / len(pids),
            "host_out_bps": (out1 - out0) / seconds, "host_in_bps": (in1 - in0) / seconds}


def _finish(directory: Path) -> None:
    """End every worker: each reads the FIFO, which ends once a writer came and went."""
    try:
        fd = os.open(directory / "finish", os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return      # no worker reads it
    time.sleep(1.0)
    os.close(fd)


def _wait(proc, deadline: float) -> int | None:
    try:
        return proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return None


def _failed(result: dict, said: list, what: str) -> dict:
    result["error"] = f"{what}: " + " | ".join(line for _, line in said[-8:])
    return result


def spec_cost(nodes: int, reps: int = 20) -> dict:
    """An elastic round's spec for ``nodes`` nodes (every node's host name and address
    are in it, so that any can take over): its bytes, and node 0's seconds to encode it
    once and sign it for every link."""
    spec = RoundSpec(
        backend="horovod", nnodes=nodes, nodes=list(range(nodes)), nproc=1, servers=0,
        restart=1, reformation=1, elastic=True, master_addr="10.213.4.1",
        transport="gloo", hosts=[None] + [f"dgc1a2b3c-h{i}" for i in range(1, nodes)],
        slots=[1] * nodes, server_counts=[0] * nodes, rendezvous_port=40000,
        addresses=[[f"10.213.{4 + i // 250}.{1 + i % 250}", 29500] for i in range(nodes)],
        restarts=1)
    began = time.perf_counter()
    for _ in range(reps):
        text = channel.encode(Start(spec))
    encode = (time.perf_counter() - began) / reps
    seal = channel._Seal("s" * 64, "c" * 32, "m")
    began = time.perf_counter()
    for _ in range(reps):
        seal.seal(text)
    sign = (time.perf_counter() - began) / reps
    return {"nodes": nodes, "bytes": len(text), "encode_s": encode,
            "sign_all_s": sign * (nodes - 1)}


def run(sizes, timeout: float, log) -> dict:
    """Every size, static then elastic, each on a fresh cluster of that many hosts."""
    results = {"sizes": list(sizes), "steady_s": STEADY, "targets": TARGETS, "jobs": [],
               "spec": [spec_cost(nodes) for nodes in sizes]}
    with tempfile.TemporaryDirectory(prefix="dg-bench-scale-") as tmp:
        for nodes in sizes:
            began = time.monotonic()
            with emulated_cluster.EmulatedCluster(num_hosts=nodes) as cluster:
                log(f"scale: {nodes} hosts made in {time.monotonic() - began:.1f} s")
                for elastic in (False, True):
                    job = run_job(cluster, elastic, Path(tmp), timeout, log)
                    if "error" in job:
                        log(f"  {job['mode']} {nodes} nodes FAILED: {job['error'][:600]}")
                    results["jobs"].append(job)
    return results


def write(results: dict, md_path: Path) -> None:
    """The report (markdown) and the raw numbers (JSON beside it)."""
    machine = results.get("machine", {})
    lines = [
        "# The launchers' control plane against the number of nodes (bench-cluster part 9)",
        "",
        f"Command: `{results.get('command', '')}`; {results.get('date', '')}; "
        f"CPU: {machine.get('cpu', '?')}, {machine.get('cores', '?')} cores; load average "
        f"at the start {results.get('load_start', [0])[0]:.2f}, at the end "
        f"{results.get('load_end', [0])[0]:.2f} (the jobs' own launchers count in it).",
        "",
        "One launcher and one light worker (a shell that waits on a FIFO) per emulated host, "
        "all launchers started at once (one loop of `ip netns exec ... python -m "
        "dist_gluon.launch`); `--backend horovod -n 1`, default --heartbeat 0.5 and "
        "--silence-limit 8. Every host shares this machine's cores, so the launchers' own "
        "start (about 0.1 s of CPU each) is most of a large formation. *Formation*: first "
        "launcher started -> last worker started (*spawned*: the loop that starts the "
        "launchers ended; *round sent*: node 0 sent the first round's start). "
        "*Re-formation*: static, a worker SIGKILLed (--max-restarts 1; node 0 lets "
        "near-simultaneous failures land for 0.5 s before it judges) -> every worker of the "
        "restart started; elastic (--nnodes 2:N), a host's every process SIGKILLed -> the "
        "N-1 survivors' workers started (*decided*: node 0 said the next round). Steady "
        f"state over {results.get('steady_s', STEADY):g} s of the running round: node 0's "
        "launcher's CPU and its link's bytes per second (and per other node), and every "
        "launcher's CPU per node.",
        "",
        "| nodes | job | formation s (spawned; round sent) | re-formation s (decided) "
        "| node 0 CPU ms/s (per node) | node 0 in kB/s (per node) | node 0 out kB/s "
        "(per node) | CPU ms/s per launcher | load at start |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for job in results["jobs"]:
        if "form_s" not in job:
            lines.append(f"| {job['nodes']} | {job['mode']} | failed: "
                         f"{job.get('error', '')[:200]} | | | | | | |")
            continue
        others = max(1, job["nodes"] - 1)
        reform = (f"{job['reform_s']:.1f} ({_s(job.get('reform_said_s'))})"
                  if "reform_s" in job else "failed")
        lines.append(
            f"| {job['nodes']} | {job['mode']} | {job['form_s']:.1f} "
            f"({job['spawn_s']:.1f}; {_s(job.get('form_start_s'))}) | {reform} | "
            f"{1e3 * job['host_cpu']:.0f} ({1e3 * job['host_cpu'] / others:.2f}) | "
            f"{job['host_in_bps'] / 1e3:.1f} ({job['host_in_bps'] / 1e3 / others:.2f}) | "
            f"{job['host_out_bps'] / 1e3:.1f} ({job['host_out_bps'] / 1e3 / others:.2f}) | "
            f"{1e3 * job['cpu_per_node']:.1f} | {job['load_start'][0]:.2f} |")
    lines += ["", "The round's spec (sent to every node at each round's start; it lists "
              "every node, so that any can take the job over): its size, and node 0's time "
              "to encode it once and sign it for every other node, in this process:", "",
              "| nodes | spec bytes (per node) | encode ms | sign for all links ms |",
              "|---|---|---|---|"]
    lines += [f"| {c['nodes']} | {c['bytes']} ({c['bytes'] / c['nodes']:.0f}) | "
              f"{1e3 * c['encode_s']:.2f} | {1e3 * c['sign_all_s']:.2f} |"
              for c in results.get("spec", [])]
    failed = [f"{j['mode']} {j['nodes']}: {j['error']}" for j in results["jobs"]
              if "error" in j]
    if failed:
        lines += ["", "Failures:", ""] + [f"- {f[:800]}" for f in failed]
    lines += ["", f"Targets at 256 nodes on this machine: formation <= "
              f"{TARGETS['form']:g} s, re-formation after a lost node <= "
              f"{TARGETS['reform']:g} s.", ""]
    md_path.write_text("\n".join(lines))
    md_path.with_name(md_path.stem.lower() + ".json").write_text(
        json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    # a quick look: python benchmarks/cluster/scale.py 4 16
    out = run([int(n) for n in sys.argv[1:]] or QUICK_SIZES, 300.0,
              lambda m: print(m, flush=True))
    print(json.dumps(out, indent=1, default=str))
