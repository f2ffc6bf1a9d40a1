"""Render `itif plan --json` result files as a markdown section.

    python bench/plan_table.py bench/results/cpu-plan-*.json > plans.md

(docs/performance.md renders the committed ones itself: ``python -m itif.bench.perf_doc``.)
"""

from __future__ import annotations

import json
import sys


def render(paths: list[str]) -> str:
    out = ["", "## Planner strategies on one batch (`itif plan`)", "",
           "One batch planned by every strategy and run through the engine. *predicted*: the "
           "whole-batch cost model (`itif.calibration.batch_cost`, calibrated on this machine, no "
           "online correction); *measured*: best of 9 rounds in which the strategies take turns; "
           "*error*: predicted / measured - 1 (the bar: within 15 %, and the ranking the "
           "predictions imply matches the measured one up to ties within 5 %).", ""]
    for p in paths:
        r = json.load(open(p))
        out += [f"**{r['workload']}**, {r['requests']} requests over {r['tenants']} tenants, "
                f"{r['backbone']}, {r['device']}, {r.get('date', '')} (`{p}`)", "",
                "| strategy | padded tokens | useful tokens | predicted ms | measured ms | "
                "error | vs pad_to_max | plan us/request | GEMM calls |",
                "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        base = r["strategies"]["pad_to_max"]["measured_ms"]
        for name, s in r["strategies"].items():
            err = s["predicted_ms"] / s["measured_ms"] - 1
            out.append(f"| {name} | {s['padded_tokens']} | {s['useful_tokens']} | "
                       f"{s['predicted_ms']:.0f} | {s['measured_ms']:.0f} | {err:+.1%} | "
                       f"{base / s['measured_ms']:.2f}x | {s['plan_us_per_request']:.2f} | "
                       f"{s['gemm_calls']} |")
        pred = r.get("prediction")
        if pred:  # ranking pairs the prediction orders against a clear (> 5 %) measured gap
            pairs = pred["discordant_pairs"]
            out += ["", "Ranking implied by the predictions: "
                    + ("agrees with the measured one." if not pairs else
                       "disagrees on " + ", ".join(f"{a} < {b}" for a, b in pairs) + ".")]
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(render(sys.argv[1:]))
