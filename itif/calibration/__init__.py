"""Calibration: measure the engine, fit the whole-batch cost model, report ``itif plan``.

This package sits above ``itif.runtime`` because it drives the engine (a forward timed per
layout, a batch planned by every strategy and run): ``itif.batching`` (layouts, strategies,
the cost model's tables) stays below the runtime that plans with it, so the two never import
each other. ``batch_cost`` fits and predicts, ``batch_timing`` holds its clock and timings,
``plan_report`` is ``itif plan``.
"""
