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


def _compute(entry: dict) -> float | None:
    """The compute-only step timed in the same job, before and after the trainer."""
    found = entry.get("results", {}).get(entry.get("impl"))
    return None if not found else found.get("compute_seconds")


def _step(entry: dict) -> float | None:
    found = entry.get("results", {}).get(entry["impl"])
    return None if not found else found["seconds"]


def _throughput(rows: list[dict]) -> list[str]:
    lines = ["| model | link | per-step averaging: compute-only step; step, scaling | "
             "compute-only step | DiLoCo H, pseudo-gradient | round / H | "
             "synchronisation alone | scaling | derived: scaling at H = 128 |",
             "|---|---|---|---|---|---|---|---|---|"]
    keys = sorted({(r["model"], r["rate"]) for r in rows},
                  key=lambda k: (k[0], -len(k[1]), k[1]))
    for model, rate in keys:
        mine = {r["impl"]: r for r in rows if (r["model"], r["rate"]) == (model, rate)}
        per_step = _step(mine["per_step"]) if "per_step" in mine else None
        compute = _compute(mine.get("per_step", {}))
        base = (f"{compute:.2f} s; {per_step:.2f} s, {compute / per_step:.0%}"
                if per_step and compute else
                mine.get("per_step", {}).get("error", "–")[:80])
        for impl, entry in mine.items():
            if not impl.startswith("diloco"):
                continue
            compute = _compute(entry)
            figures = _round_figures(entry)
            wire = {"diloco_fp16": "float16", "diloco_2bit": "2-bit",
                    "diloco_powersgd": "PowerSGD rank 4"}.get(
                impl.partition(":")[0].removesuffix("_overlap"), "float32")
            if "overlap" in impl:
                wire += ", overlapped with the next round (sync_delay = H)"
            if figures is None or not compute:
                lines.append(f"| {model} | {rate} | {base} | – | {impl} | "
                             f"{entry.get('error', 'no result')[:80]} | | | |")
                continue
            sync = "–" if figures["sync"] is None else f"{figures['sync']:.1f} s"
            derived = "–" if figures["sync"] is None else \
                f"{compute / (figures['local'] + figures['sync'] / 128):.0%}"
            lines.append(
                f"| {model} | {rate} | {base} | {compute:.2f} s | {figures['every']}, {wire} | "
                f"{figures['step']:.2f} s | {sync} | "
                f"{compute / figures['step']:.0%} | {derived} |")
    return lines


def _by_flags(rows: list[dict], field: str, digits: int, against: str,
              scale: float) -> list[str]:
    """One line per (workers, flags): the mean of ``field`` over the seeds, each seed's,
    and the mean's difference to per-step averaging's (times ``scale``)."""
    lines = [f"| workers | the example's flags | {field}, mean of seeds | each seed | "
             f"against per-step ({against}) |",
             "|---|---|---|---|---|"]
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["workers"], tuple(r["flags"])), []).append(r)
    for key in groups:
        workers, flags = key
        base = [r.get(field, float("nan")) for r in groups.get((workers, ()), [])]
        runs = groups[key]
        values = [r[field] for r in runs if field in r]
        seeds = ", ".join(f"{r[field]:.{digits}f}" if field in r else "failed"
                          for r in runs)
        what = " ".join(flags) or "(per-step averaging)"
        if len(values) != len(runs) or not values:
            lines.append(f"| {workers} | `{what}` | – | {seeds} | – |")
            continue
        mean = statistics.mean(values)
        delta = "–" if not flags or not base else \
            f"{(mean - statistics.mean(base)) * scale:+.2f}"
        lines.append(f"| {workers} | `{what}` | {mean:.{digits}f} | {seeds} | {delta} |")
    return lines


def _mnist(rows: list[dict]) -> list[str]:
    return _by_flags(rows, "val_acc", 4, "points", 100)


def _lm(rows: list[dict]) -> list[str]:
    return _by_flags(rows, "val_ppl", 1, "perplexity", 1)


def _measured(what: dict) -> str:
    parts = []
    if what["rates"]:
        parts.append(f"throughput of {', '.join(what['models'])} at "
                     f"{', '.join(what['rates'])}")
    if what["mnist_workers"]:
        parts.append(f"MNIST on {', '.join(map(str, what['mnist_workers']))} workers")
    if what.get("lm_workers"):
        parts.append(f"the language model on {', '.join(map(str, what['lm_workers']))} "
                     "workers")
    return " and ".join(parts) or "nothing"


def write(results: dict, path: Path) -> None:
    machine = results["machine"]
    cfg = results["config"]
    mnist = cfg["mnist"]
    text = [
        "# bench-cluster part 8: Local SGD and DiLoCo on slow links",
        "",
        f"{machine.get('cpu', machine.get('cpu_model', '?'))}, {machine.get('cores')} cores "
        "shared by every emulated host and by whatever else ran on the machine (other "
        "engineers' tests: the load below). The runs that measured this report, each "
        "replacing what it measured:",
        "",
        *[f"- `{run['command']}`: {_measured(run['measured'])}; load at the start "
          f"`{run['uptime_start']}`, at the end `{run['uptime_end']}`."
          for run in results["runs"]],
        "",
        "## Throughput",
        "",
        f"{cfg['hosts']} emulated hosts (tools/emulated_cluster.py), one worker each, "
        "horovod over Gloo; SGD momentum 0.9 inside, DiLoCo's outer step NAG lr 0.7 "
        "momentum 0.9. Scaling is the compute-only step (gluon.Trainer(kvstore=None), no "
        "communication, timed in the same job right before and after the trainer, the "
        "mean of both) over the step. A round's H steps are "
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
        f"32 per worker, the example's defaults otherwise (learning rate 0.02, momentum "
        f"0.9, cosine decay after a 1-epoch warm-up; per-step averaging scales the rate "
        f"with the workers, rounds keep one worker's unless `--scale-lr`), seeds "
        f"{list(mnist['seeds'])}, horovod on one host. The accuracy is the summary line's, "
        "after the last (shortened) round's synchronisation. A diverged run (NaN loss, "
        "chance accuracy) counts in the mean as it ended.",
        "",
        *_mnist(results["mnist"]),
        "",
    ]
    lm = cfg.get("lm")
    if results.get("lm") and lm:
        text += [
            "## Language model perplexity",
            "",
            f"examples/language_model/train_lm.py with `{' '.join(lm['args'])}` (a part "
            f"of each training document), {lm['epochs']} epochs, the example's defaults "
            "otherwise (SGD lr 20 unscaled, clipping 0.25 of the global batch's norm, "
            "divided for a local step), seeds "
            f"{list(lm['seeds'])}, horovod on one host. The perplexity is the summary "
            "line's: the last epoch's validation perplexity, of the synchronised weights "
            "(the example cuts an epoch's last round short). A round longer than an "
            "epoch is cut at the epoch's end.",
            "",
            *_lm(results["lm"]),
            "",
        ]
    path.write_text("\n".join(text))
