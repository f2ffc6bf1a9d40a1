"""Render `itif plan --json` result files as a markdown section (for docs/performance.md).

    python bench/plan_table.py bench/results/cpu-plan-*.json >> docs/performance.md
"""

from __future__ import annotations

import json
import sys


def render(paths: list[str]) -> str:
    out = ["", "## Planner strategies on one batch (`itif plan`)", ""]
    for p in paths:
        r = json.load(open(p))
        out += [f"**{r['workload']}**, {r['requests']} requests over {r['tenants']} tenants, "
                f"{r['backbone']}, {r['device']} (`{p}`)", "",
                "| strategy | padded tokens | useful tokens | predicted ms | measured ms | "
                "vs pad_to_max | plan us/request | GEMM calls |",
                "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        base = r["strategies"]["pad_to_max"]["measured_ms"]
        for name, s in r["strategies"].items():
            out.append(f"| {name} | {s['padded_tokens']} | {s['useful_tokens']} | "
                       f"{s['predicted_ms']:.0f} | {s['measured_ms']:.0f} | "
                       f"{base / s['measured_ms']:.2f}x | {s['plan_us_per_request']:.2f} | "
                       f"{s['gemm_calls']} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(render(sys.argv[1:]))
