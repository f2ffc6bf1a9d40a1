"""``itif bench``: the fused engine against one-instance-per-tenant baselines on the same weights
and inputs, a serving sweep through the real daemon, rooflines, plots and the performance doc.

Modules: ``workloads`` (what is measured), ``tenants`` (weights, Hugging Face export and models),
``systems`` (seq, multi_stream, hf, itif), ``mps`` (process per tenant under MPS), ``offline``
(per-call measurements), ``serving`` (Poisson load over gRPC), ``roofline``, ``meta`` (what a
result records), ``thesis`` (Table 5.2 as published), ``plots``, ``report`` (every table of
one result file), ``perf_doc`` (docs/performance.md from the committed results) and ``cli``.
Nothing heavy is imported here.
"""
