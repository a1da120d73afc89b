"""Turn the jobs' JSON into the report: markdown tables (per network setting and a summary).

Why separate from the launcher: the reports are regenerated from the JSON files a run wrote
(``python -m benchmarks.run --report-only``) without rerunning anything.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from . import variants as V

__all__ = ["net_markdown", "summary_markdown", "load_runs", "fmt_bytes", "best_ours", "paired_ratio", "paired_ratios",
           "paired_spread", "tta_missed"]

BASELINES = V.BASELINES


def fmt_bytes(b: float | None) -> str:
    if b is None:
        return "–"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(b) >= scale:
            return f"{b / scale:.3g} {unit}"
    return f"{b:.0f} B"


def _mean(xs: list | None) -> float | None:
    xs = [x for x in (xs or []) if x is not None]
    return sum(xs) / len(xs) if xs else None


def best_ours(res: dict[str, Any], exclude: tuple[str, ...] = ()) -> str | None:
    """Our fastest variant (highest samples/s), excluding the baselines (and ``exclude``)."""
    ours = {k: v for k, v in res.items() if k not in BASELINES and k not in exclude}
    return max(ours, key=lambda k: ours[k]["samples_per_s"]) if ours else None


def paired_ratios(res: dict[str, Any], name: str, base: str = "ddp") -> list[float] | None:
    """Each block's ``base`` block time over ``name``'s in the same block (rank 0), in block
    order; None where the blocks do not pair up."""
    a = res.get(name, {}).get("block_step_s_rank0")
    b = res.get(base, {}).get("block_step_s_rank0")
    if not a or not b or len(a) != len(b):
        return None
    return [y / x for x, y in zip(a, b) if x > 0] or None


def paired_ratio(res: dict[str, Any], name: str, base: str = "ddp") -> float | None:
    """The median over blocks of ``base``'s block time over ``name``'s in the same block (rank 0):
    the variants take turns block by block, so a load that slows one block slows both sides of
    its ratio, where the ratio of the two medians takes them from different blocks."""
    ratios = paired_ratios(res, name, base)
    return statistics.median(ratios) if ratios else None


def paired_spread(res: dict[str, Any], name: str, base: str = "ddp") -> str:
    """The per-block ratios as the table prints them: their range and each block's, in block
    order ("0.88-1.13: 0.88 0.95 1.13"); what a job can resolve is read from it: a median of
    ratios that spread 0.88-1.13 does not settle a 5 % difference (docs/benchmarking.md#paired-blocks)."""
    ratios = paired_ratios(res, name, base)
    if not ratios:
        return "–"
    return f"{min(ratios):.2f}-{max(ratios):.2f}: " + " ".join(f"{r:.2f}" for r in ratios)


def _throughput_table(job: dict[str, Any]) -> list[str]:
    res = job["results"]
    ddp = res.get("ddp", {}).get("step_s")
    comp = res.get("compute", {}).get("step_s")
    warm = job.get("block_warmup_steps")
    after = f", each after {warm} untimed" if warm else ""
    lines = [f"**{job['model']}** ({job['params'] / 1e6:.2f}M parameters, batch {job['batch_per_rank']}/rank, "
             f"median of {job['blocks']} blocks x {job['steps_per_block']} steps{after}, slowest rank)", ""]
    if ddp and comp:
        lines += [f"DDP communication-to-computation ratio (DDP step / compute-only step): **{ddp / comp:.2f}**", ""]
    lines += ["| variant | samples/s | step (ms) | speed-up vs DDP | paired vs DDP | of compute bound | "
              "accounted B/step/rank | link B/step/rank | link/acct | paired vs DDP per block |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, r in sorted(res.items(), key=lambda kv: -kv[1]["samples_per_s"]):
        acct = _mean(r.get("bytes_sent_per_step_accounted"))
        kind = ""
        if acct is None and r.get("bytes_per_step_analytic") is not None:
            acct, kind = r["bytes_per_step_analytic"], " (analytic)"
        link = _mean(r.get("link_tx_bytes_per_step"))
        ratio = f"{link / acct:.2f}" if acct and link is not None else "–"
        vs_ddp = f"{ddp / r['step_s']:.2f}x" if ddp else "–"
        pr = paired_ratio(res, name)
        paired = f"{pr:.2f}x" if pr is not None else "–"
        of_bound = f"{comp / r['step_s'] * 100:.0f}%" if comp else "–"
        lines.append(f"| {name} | {r['samples_per_s']:.1f} | {r['step_s'] * 1e3:.1f} | {vs_ddp} | {paired} | "
                     f"{of_bound} | {fmt_bytes(acct)}{kind} | {fmt_bytes(link)} | {ratio} | {paired_spread(res, name)} |")
    return lines


def _lm_tta_table(job: dict[str, Any]) -> list[str]:
    res = job["results"]
    shape = job.get("shape", {})
    lines = [f"**Time to validation loss**: transformer ({job['params'] / 1e6:.2f}M parameters, {shape.get('layers')} "
             f"layers, width {shape.get('width')}, byte-level stdlib text), {job['steps']} steps of "
             f"{job['batch_per_rank']} x {job['context']} tokens per rank, {job['optimizer']} lr {job['lr']:g} "
             f"(warm-up {job['lr_warmup_steps']} steps), validation every {job['eval_every']} steps on "
             f"{job['eval_windows']} held-out windows (initial loss {job['initial_val_loss']:.3f}), target "
             f"{job['target']:g}; sparse density {job['density']:g}, averaging period {job['period']}", "",
             "| variant | time to target (s) | steps to target | final val loss | vs DDP's | step (s) |",
             "|---|---:|---:|---:|---:|---:|"]
    ddp = res.get("ddp", {}).get("final_val_loss")
    for name, r in sorted(res.items(), key=lambda kv: (kv[1]["time_to_target_s"] is None,
                                                       kv[1]["time_to_target_s"] or 0)):
        t = r["time_to_target_s"]
        rel = f"{(r['final_val_loss'] / ddp - 1) * 100:+.1f}%" if ddp else "–"
        hit = f"{t:.1f} | {r['steps_to_target']}" if t is not None else "not reached | –"
        lines.append(f"| {name} | {hit} | {r['final_val_loss']:.4f} | {rel} | {r['step_s']:.3f} |")
    return lines


def _tta_table(job: dict[str, Any]) -> list[str]:
    if job.get("task") == "lm":
        return _lm_tta_table(job)
    res = job["results"]
    lines = [f"**Time to accuracy**: digits CNN ({job['params'] / 1e3:.1f}k parameters), {job['epochs']} epochs x "
             f"{job['steps_per_epoch']} steps, batch {job['batch_per_rank']}/rank, lr {job['lr']:g}, target "
             f"test accuracy {job['target']:.2f}; sparse density {job['density']:g}, averaging period "
             f"{job['period']}, schedule warm-up {job['schedule_warmup_steps']} steps", "",
             "| variant | time to target (s) | epochs to target | final accuracy | epoch (s) |",
             "|---|---:|---:|---:|---:|"]
    for name, r in sorted(res.items(), key=lambda kv: (kv[1]["time_to_target_s"] is None,
                                                       kv[1]["time_to_target_s"] or 0)):
        t = r["time_to_target_s"]
        lines.append(f"| {name} | {t:.2f} | {r['epochs_to_target']} | {r['final_acc']:.4f} | {r['epoch_s']:.2f} |"
                     if t is not None else
                     f"| {name} | not reached | – | {r['final_acc']:.4f} | {r['epoch_s']:.2f} |")
    return lines


def _skipped(jobs: list[dict[str, Any]]) -> list[str]:
    seen: dict[str, str] = {}
    for job in jobs:
        for k, s in job.get("status", {}).items():
            if s != "ok" and k not in seen:
                seen[k] = s
    return [f"* `{k}`: {s}" for k, s in seen.items()]


def net_markdown(run: dict[str, Any]) -> str:
    """The report of one network setting (one ``bench_<net>.json``)."""
    m = run["machine"]
    c = run["cluster"]
    jobs = run["jobs"]
    first = next((j for j in jobs if "mpi_library" in j), {})
    lines = [f"## Network {run['net']}: {c['network']}", "",
             f"* when: {run['started']}; {run['ranks']} ranks, 1 thread each; mode: {'quick' if run['quick'] else 'full'}",
             f"* emulation: {c['network']}" + (f" (rate {c['rate']}, tbf burst {c['burst_bytes']} B)" if c.get('rate') else "")
             + (f"; loopback because: {c['fallback_reason']}" if c.get("fallback_reason") else ""),
             f"* our backend: {first.get('backend', '?')}; MPI library: {first.get('mpi_library', '?')} "
             f"(launcher: {c.get('launcher_version', '?')}); DDP: torch {m.get('torch')} Gloo",
             f"* machine: {m.get('platform')}, {m.get('cpus')} CPUs, Python {m.get('python')}, numpy {m.get('numpy')}",
             ""]
    for job in jobs:
        if job.get("started") and job.get("started") != run["started"]:
            lines += [f"_({job.get('model', 'tta')}: from the run of {job['started']})_", ""]
        if job.get("error"):
            lines += [f"**{job.get('model', job.get('mode'))}: job failed**: {job['error']}", ""]
        elif job["mode"] == "throughput":
            lines += _throughput_table(job) + [""]
            chk = job.get("link_check")
            if chk:
                lines += [f"Link check, whole job: {chk['source']} {chk['tc']}; the ranks' own interface "
                          f"counters {chk['worker']}.", ""]
        elif job["mode"] == "tta":
            lines += _tta_table(job) + [""]
    sk = _skipped(jobs)
    if sk:
        lines += ["Skipped or failed:", ""] + sk + [""]
    return "\n".join(lines)


def summary_markdown(runs: list[dict[str, Any]]) -> str:
    """One table across network settings: DDP's comm/compute ratio, PowerSGD and our best."""
    lines = ["| network | model | DDP comm/compute | DDP samples/s | PowerSGD r1 / r4 vs DDP | best of ours | "
             "its speed-up vs DDP | best of ours reaching the TTA target | its speed-up | SSGD vs DDP | "
             "DDP + bf16 / fp16 hook vs DDP |",
             "|---|---|---:|---:|---:|---|---:|---|---:|---:|---:|"]
    for run in runs:
        for job in run["jobs"]:
            if job.get("mode") != "throughput" or job.get("error"):
                continue
            missed = tta_missed(run, job["model"])
            res = job["results"]
            ddp, comp = res.get("ddp", {}).get("step_s"), res.get("compute", {}).get("step_s")
            if not ddp:
                continue

            def sp(k: str) -> str:
                return f"{ddp / res[k]['step_s']:.2f}x" if k in res else "–"
            best = best_ours(res)
            ok = best_ours({k: v for k, v in res.items() if k not in missed})
            lines.append(f"| {run['cluster']['network']} | {job['model']} | {ddp / comp:.2f} | "
                         f"{res['ddp']['samples_per_s']:.1f} | {sp('ddp_powersgd1')} / {sp('ddp_powersgd4')} | "
                         f"{best or '–'} | {sp(best) if best else '–'} | {ok or '–'} | {sp(ok) if ok else '–'} | "
                         f"{sp('ssgd')} | {sp('ddp_bf16')} / {sp('ddp_fp16')} |" if comp else "")
    return "\n".join(line for line in lines if line)


def tta_missed(run: dict[str, Any], model: str) -> set[str]:
    """The variants that missed the time-to-accuracy target of the job that stands for ``model``'s
    accuracy: the transformer's own (validation loss), the digits CNN's for the other models."""
    task = "lm" if model == "transformer" else "digits"
    tta = next((j for j in run["jobs"] if j.get("mode") == "tta" and j.get("results")
                and j.get("task", "digits") == task), None)
    return set() if tta is None else {k for k, v in tta["results"].items() if v["time_to_target_s"] is None}


def load_runs(results_dir: Path) -> list[dict[str, Any]]:
    """Every ``bench_<net>.json`` in ``results_dir``, fastest network first."""
    runs = []
    for p in sorted(results_dir.glob("bench_*.json")):
        try:
            runs.append(json.loads(p.read_text()))
        except ValueError:
            continue
    from benchmarks.netemu import parse_rate  # noqa: PLC0415 - shared with the launcher
    def key(r: dict) -> float:
        try:
            return -parse_rate(r["net"])
        except ValueError:
            return 0.0
    return sorted(runs, key=key)


def variant_legend(names: list[str]) -> str:
    return "\n".join(f"* `{n}`: {V.describe(n)}" for n in names)
