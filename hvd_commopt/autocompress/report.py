"""The text of ``compression="auto"``'s report (verbose mode prints it on rank 0)."""
from __future__ import annotations

from typing import Any

__all__ = ["format_report"]


def _ms(x: Any) -> str:
    return "-" if x is None else f"{x * 1e3:.3f} ms"


def format_report(rep: dict[str, Any]) -> str:
    """Per bucket: the method chosen and why; the predicted step (with dense fp32 beside it) and
    the measured one once measured."""
    which = "before step 0" if rep.get("phase") == "before step 0" else f"decision {rep.get('decisions', 1)}"
    lines = [f"[hvd_commopt] compression='auto' ({which}): predicted step "
             f"{_ms(rep['predicted_s'])} (dense fp32 {_ms(rep['dense_predicted_s'])}), measured "
             f"{_ms(rep.get('measured_s'))}; re-decides beyond {rep['margin']:.0%} after {rep['period']} steps"]
    if rep.get("kinds"):
        lines.append(f"  {rep['kinds']}")
    if rep.get("reverted"):
        lines.append(f"  reverted: {rep['reverted']}")
    if rep.get("revert_check"):
        lines.append(f"  revert checked: {rep['revert_check']}")
    if rep.get("trying"):
        lines.append(f"  measuring next: {rep['trying']}")
    if rep.get("trial"):
        lines.append(f"  measured after the decision: {rep['trial']}")
    for b in rep["buckets"]:
        lines.append(f"  {b['bucket']} ({b['bytes']} B): {b['method']} - {b['why']}")
    return "\n".join(lines)
