"""Markdown cells and tables shared by the bench reports (``report``, ``gpu_report``,
``perf_doc``): one place, so every generated page writes a millisecond or a ratio the same way,
and neither report imports the other for them (``report`` already imports ``gpu_report``)."""

from __future__ import annotations

__all__ = ["fmt_ms", "fmt_x", "md_table"]


def fmt_ms(v) -> str:
    """Milliseconds as a table cell: 3 significant digits under 10, one decimal above; "–" for
    None."""
    if v is None:
        return "–"
    return f"{v:.3g}" if v < 10 else f"{v:.1f}"


def fmt_x(v) -> str:
    """A ratio as a table cell ("1.23×"); "–" for None."""
    return "–" if v is None else f"{v:.2f}×"


def md_table(header: list[str], body: list[list[str]]) -> str:
    """A markdown table of ``header`` and ``body`` (each cell through ``str``)."""
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in body]
    return "\n".join(out)
