"""The fusion tuner's report as text: what verbose mode prints once on rank 0 (:mod:`.tuner`).

The report itself is a dict (``FusionTuner.report``, ``DistributedOptimizer.fusion_report``);
this is only its few-line rendering, bucket sizes in MiB and times in ms.
"""
from __future__ import annotations

from typing import Any, Mapping

__all__ = ["format_report"]


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}" if n >= 2**14 else f"{n / 2**20:.4f}"


def format_report(rep: Mapping[str, Any]) -> str:
    """The report as a few lines of text (what verbose mode prints)."""
    sizes = rep.get("bucket_bytes", [])
    shown = ", ".join(_mib(b) for b in sizes[:12]) + (", ..." if len(sizes) > 12 else "")
    lines = [f"hvd_commopt fusion: strategy={rep['strategy']} -> {rep['chosen']}: {rep['buckets']} bucket(s), "
             f"MiB [{shown}]"]
    if "predicted_s" in rep:
        meas = rep.get("measured_s")
        err = rep.get("prediction_error")
        lines.append(f"  iteration: predicted {rep['predicted_s'] * 1e3:.2f} ms, measured "
                     + (f"{meas * 1e3:.2f} ms over {rep['measured_steps']} steps ({err:+.1%})"
                        if meas is not None else "n/a"))
        th = rep["threshold"]
        lines.append(f"  threshold plan ({th['buckets']} bucket(s)): predicted {th['predicted_s'] * 1e3:.2f} ms, "
                     f"measured {th['measured_s'] * 1e3:.2f} ms while profiling")
        cands = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in rep["candidates_s"].items())
        lines.append(f"  predicted ms: {cands}")
        p = rep["profile"]
        lines.append(f"  profile (rank 0, {p['steps']} steps): {p['tensors']} tensors, "
                     f"forward {p['forward_s'] * 1e3:.2f} ms, "
                     f"backward {p['backward_s'] * 1e3:.2f} ms; {rep['comm']}")
    return "\n".join(lines)
