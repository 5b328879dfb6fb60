"""The report of bench-cluster's part 8 (Local SGD and DiLoCo on slow links):
RESULTS-cluster-slow-links.md, from the results run_cluster.run_slow_links returns."""
from __future__ import annotations

import statistics
from pathlib import Path


def _round_figures(entry: dict) -> dict | None:
    """Step time of a DiLoCo entry (a timed round / H), its synchronisation alone, and
    the local step's time that follows: a round is H local steps plus one
    synchronisation."""
    found = entry.get("results", {}).get(entry["impl"])
    if not found:
        return None
    every = found["every"]
    step = found["round"]["seconds"]
    sync = found["sync_seconds"]
    local = step if sync is None else max(step - sync / every, 0.0)
    return {"every": every, "step": step, "sync": sync, "local": local,
            "busy": found["round"]["machine_busy"]}


def _step(entry: dict) -> float | None:
    found = entry.get("results", {}).get(entry["impl"])
    return None if not found else found["seconds"]


def _throughput(rows: list[dict]) -> list[str]:
    lines = ["| model | link | compute-only step | per-step averaging: step, scaling | "
             "DiLoCo H, pseudo-gradient | round / H | synchronisation alone | scaling | "
             "derived: scaling at H = 128 |",
             "|---|---|---|---|---|---|---|---|---|"]
    keys = sorted({(r["model"], r["rate"]) for r in rows},
                  key=lambda k: (k[0], -len(k[1]), k[1]))
    for model, rate in keys:
        mine = {r["impl"]: r for r in rows if (r["model"], r["rate"]) == (model, rate)}
        compute = _step(mine["compute"]) if "compute" in mine else None
        per_step = _step(mine["per_step"]) if "per_step" in mine else None
        base = (f"{per_step:.2f} s, {compute / per_step:.0%}" if per_step and compute
                else mine.get("per_step", {}).get("error", "–")[:80])
        for impl, entry in mine.items():
            if not impl.startswith("diloco"):
                continue
            figures = _round_figures(entry)
            wire = "float16" if impl.startswith("diloco_fp16") else "float32"
            if "overlap" in impl:
                wire += ", overlapped with the next round (sync_delay = H)"
            if figures is None or not compute:
                lines.append(f"| {model} | {rate} | – | {base} | {impl} | "
                             f"{entry.get('error', 'no result')[:80]} | | | |")
                continue
            sync = "–" if figures["sync"] is None else f"{figures['sync']:.1f} s"
            derived = "–" if figures["sync"] is None else \
                f"{compute / (figures['local'] + figures['sync'] / 128):.0%}"
            lines.append(
                f"| {model} | {rate} | {compute:.2f} s | {base} | {figures['every']}, {wire} | "
                f"{figures['step']:.2f} s | {sync} | "
                f"{compute / figures['step']:.0%} | {derived} |")
    return lines


def _mnist(rows: list[dict]) -> list[str]:
    lines = ["| workers | synchronisation | val_acc, mean of seeds | min - max | "
             "against per-step (points) | runs |",
             "|---|---|---|---|---|---|"]
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["workers"], r["every"], r["outer_lr"]), []).append(r)
    for workers in sorted({k[0] for k in groups}):
        base = [r["val_acc"] for r in groups.get((workers, 1, None), []) if "val_acc" in r]
        base_mean = statistics.mean(base) if base else None
        for key in sorted((k for k in groups if k[0] == workers),
                          key=lambda k: (k[2] is not None, k[1])):
            _, every, outer = key
            accs = [r["val_acc"] for r in groups[key] if "val_acc" in r]
            errors = [r["error"] for r in groups[key] if "error" in r]
            what = ("per step" if every == 1 and outer is None else
                    f"Local SGD, H = {every}" if outer is None else
                    f"DiLoCo, H = {every}, outer NAG lr {outer} momentum 0.9")
            if not accs:
                lines.append(f"| {workers} | {what} | failed: {errors[0][:80]} | | | 0 |")
                continue
            mean = statistics.mean(accs)
            delta = "–" if base_mean is None or key == (workers, 1, None) else \
                f"{(mean - base_mean) * 100:+.2f}"
            lines.append(f"| {workers} | {what} | {mean:.4f} | {min(accs):.4f} - "
                         f"{max(accs):.4f} | {delta} | {len(accs)}"
                         + (f" ({len(errors)} failed)" if errors else "") + " |")
    return lines


def write(results: dict, path: Path) -> None:
    machine = results["machine"]
    cfg = results["config"]
    mnist = cfg["mnist"]
    text = [
        "# bench-cluster part 8: Local SGD and DiLoCo on slow links",
        "",
        f"`{results['command']}`, {machine.get('date')}, "
        f"{machine.get('cpu', machine.get('cpu_model', '?'))}, {machine.get('cores')} cores "
        "shared by every emulated host (and by whatever else ran on the machine).",
        f"Load at the start: `{results['uptime_start']}`; at the end: "
        f"`{results['uptime_end']}`.",
        "",
        "## Throughput",
        "",
        f"{cfg['hosts']} emulated hosts (tools/emulated_cluster.py), one worker each, "
        "horovod over Gloo; SGD momentum 0.9 inside, DiLoCo's outer step NAG lr 0.7 "
        "momentum 0.9. Scaling is the compute-only step (the same job with no "
        "communication, gluon.Trainer(kvstore=None)) over the step. A round's H steps are "
        "timed whole, its last step synchronising; the synchronisation is also timed "
        "alone. The last column is derived, not measured: the local step this round "
        "implies (round / H minus the synchronisation's share) plus 1/128 of the "
        "synchronisation.",
        "",
        *_throughput(results["throughput"]),
        "",
        "## MNIST accuracy",
        "",
        f"examples/mnist/train_gluon.py (the scikit-learn digits: 1,437 training and 360 "
        f"validation images, so one image is 0.28 points), {mnist['epochs']} epochs, batch "
        f"32 per worker, the example's defaults otherwise, seeds {list(mnist['seeds'])}, "
        "horovod on one host. The accuracy is the summary line's, after the last "
        "(shortened) round's synchronisation.",
        "",
        *_mnist(results["mnist"]),
        "",
    ]
    path.write_text("\n".join(text))
