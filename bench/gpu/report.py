"""The GPU check's report: one record per check, a text table, a JSON file.

The JSON keys are stable (``SCHEMA`` names the format): a later run's report diffs
against an earlier one, and ``docs/benchmarks.md`` quotes its figures.
"""

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from areal_fn.typecheck import beartype
from bench.gpu.compare import GpuCheckError

__all__ = [
    "REPORT_FILE",
    "SCHEMA",
    "STATUSES",
    "CheckResult",
    "Report",
    "render_table",
    "report_json",
    "result_from_json",
    "write_report",
]

SCHEMA = "areal_fn.gpu_check/1"
REPORT_FILE = "report.json"
#: ``ok``: ran and passed; ``fail``: ran, a figure missed its bound; ``error``: raised;
#: ``skipped``: not run (the note says why: budget, too few GPUs, a failed launch).
STATUSES = ("ok", "fail", "error", "skipped")
Figure = float | int | bool | str


def _figures(
    value: Mapping[str, Figure] | tuple[tuple[str, Figure], ...],
) -> tuple[tuple[str, Figure], ...]:
    items = value.items() if isinstance(value, Mapping) else value
    return tuple(sorted((str(k), v) for k, v in items))


def _status(_: Any, __: Any, value: str) -> None:
    if value not in STATUSES:
        raise GpuCheckError(f"status={value!r} is not one of {STATUSES}")


@attrs.frozen(kw_only=True)
class CheckResult:
    """What one check gave: status, time against budget, figures by name, a note."""

    name: str
    status: str = attrs.field(validator=_status)
    seconds: float = 0.0
    budget_s: float = 0.0
    figures: tuple[tuple[str, Figure], ...] = attrs.field(default=(), converter=_figures)
    note: str = ""

    @property
    def figure_map(self) -> dict[str, Figure]:
        return dict(self.figures)


@attrs.frozen(kw_only=True)
class Report:
    """The whole run: versions, the budget, every check's result in run order."""

    versions: tuple[tuple[str, Figure], ...] = attrs.field(default=(), converter=_figures)
    budget_s: float
    elapsed_s: float
    results: tuple[CheckResult, ...] = ()

    @property
    def ok(self) -> bool:
        """No check failed or raised (skipped checks are listed, not failures)."""
        return all(r.status in ("ok", "skipped") for r in self.results)


def _plain(v: Figure) -> Figure:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no inf/nan
    return v


@beartype
def report_json(report: Report) -> dict[str, Any]:
    """The report as JSON-able data; the keys are the format (``SCHEMA``)."""
    return {
        "schema": SCHEMA,
        "ok": report.ok,
        "budget_s": report.budget_s,
        "elapsed_s": round(report.elapsed_s, 3),
        "versions": {k: _plain(v) for k, v in report.versions},
        "checks": [
            {
                "name": r.name,
                "status": r.status,
                "seconds": round(r.seconds, 3),
                "budget_s": r.budget_s,
                "figures": {k: _plain(v) for k, v in r.figures},
                "note": r.note,
            }
            for r in report.results
        ],
    }


@beartype
def result_from_json(data: Mapping[str, Any]) -> CheckResult:
    """A :class:`CheckResult` from one entry of ``report_json(...)["checks"]`` (or a worker's)."""
    missing = sorted({"name", "status"} - set(data))
    if missing:
        raise GpuCheckError(
            f"check record {dict(data)!r} lacks {missing}; a worker wrote it partly"
        )
    return CheckResult(
        name=str(data["name"]),
        status=str(data["status"]),
        seconds=float(data.get("seconds", 0.0)),
        budget_s=float(data.get("budget_s", 0.0)),
        figures=dict(data.get("figures", {})),
        note=str(data.get("note", "")),
    )


@beartype
def write_report(report: Report, out: Path) -> Path:
    """Write ``out/report.json`` (created, or replaced atomically); returns its path."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / REPORT_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report_json(report), indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
    return path


def _fmt(v: Figure) -> str:
    if isinstance(v, bool) or isinstance(v, int) or isinstance(v, str):
        return str(v)
    if v == 0 or 1e-3 <= abs(v) < 1e4:
        return f"{v:.4g}"
    return f"{v:.2e}"


@beartype
def render_table(report: Report) -> str:
    """A plain-text table: versions, then one row per check with its figures."""
    lines = ["versions: " + ", ".join(f"{k} {_fmt(v)}" for k, v in report.versions)]
    rows = [("check", "status", "s / budget", "figures")]
    for r in report.results:
        figs = ", ".join(f"{k}={_fmt(v)}" for k, v in r.figures)
        text = "; ".join(x for x in (figs, r.note) if x)
        rows.append((r.name, r.status, f"{r.seconds:.1f} / {r.budget_s:.0f}", text))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for i, row in enumerate(rows):
        lines.append(
            "  ".join(c.ljust(w) for c, w in zip(row[:3], widths, strict=True)) + "  " + row[3]
        )
        if i == 0:
            lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 7)
    verdict = "all checks passed" if report.ok else "SOME CHECKS FAILED"
    lines.append(
        f"{verdict}: {sum(r.status == 'ok' for r in report.results)} ok, "
        f"{sum(r.status in ('fail', 'error') for r in report.results)} failed, "
        f"{sum(r.status == 'skipped' for r in report.results)} skipped; "
        f"{report.elapsed_s:.1f} s of a {report.budget_s:.0f} s budget"
    )
    return "\n".join(lines)
