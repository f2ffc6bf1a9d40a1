"""Layouts from every strategy: invariants, padding bounds, views that share storage."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import itif
from itif.backbones.random import random_weights
from itif.batching.layer_cost import CostModel, LayerShape
from itif.batching.layout import BATCHED_GEMM, GROUPED_GEMM
from itif.batching.strategies import STRATEGIES, plan
from itif.runtime.batch import prepare

COST = CostModel.analytic(LayerShape(64, 128, 4), flops_per_ms=5e8, overhead_ms=0.05)
workloads = st.lists(st.tuples(st.integers(0, 5), st.integers(1, 128)), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(reqs=workloads)
def test_every_strategy_gives_a_valid_layout(reqs):
    tenant = np.array([t for t, _ in reqs], np.int32)
    length = np.array([n for _, n in reqs], np.int32)
    padded = {}
    for name in STRATEGIES:
        layout = plan(name, tenant, length, COST, layers=2)
        layout.check()
        assert layout.useful_tokens == int(length.sum())
        assert np.array_equal(layout.tenant, tenant) and np.array_equal(layout.length, length)
        # inside every mini-batch a tenant's rows are contiguous (one GEMM segment each)
        for m in range(len(layout.mb_size)):
            reqs_m = np.flatnonzero(layout.minibatch == m)
            t_rowwise = layout.tenant[reqs_m[np.argsort(layout.offset[reqs_m])]]
            assert len(set(t_rowwise)) == np.count_nonzero(np.diff(t_rowwise)) + 1
        padded[name] = layout.padded_tokens
    assert padded["packed"] == 0
    for name in ("itif_two_stage", "turbo_dp", "pad_per_tenant"):
        assert padded[name] <= padded["pad_to_max"], name


def test_two_stage_merges_same_shapes_across_tenants():
    tenant = np.repeat(np.arange(4, dtype=np.int32), 8)
    length = np.full(32, 40, np.int32)  # every tenant the same shape: batched GEMM material
    layout = plan("itif_two_stage", tenant, length, COST)
    assert (layout.group_op == BATCHED_GEMM).any()
    node = layout.node(0)
    assert set(node) == {
        "tenant",
        "length",
        "offset",
        "padded_len",
        "minibatch",
        "gemm_group",
        "op",
    }
    assert plan("packed", tenant, length).group_op.tolist() == [GROUPED_GEMM]


def test_views_share_storage_with_the_token_buffer():
    """Compute-bound ops see mini-batch views of the one buffer memory-bound ops see."""
    eng = itif.Engine("bert-tiny")
    for i in range(3):
        eng.add_tenant(f"t{i}", random_weights(eng.spec, 2, seed=i))
    rng = np.random.default_rng(0)
    tenant = rng.integers(0, 3, 20).astype(np.int32)
    length = rng.integers(1, 60, 20).astype(np.int32)
    layout = plan("itif_two_stage", tenant, length, COST)
    x = torch.zeros(layout.total_rows, 8)
    for m in range(len(layout.mb_size)):
        v = layout.view(x, m)
        assert v.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        v.fill_(m + 1)  # writes through the view land in the merged buffer
    assert (x > 0).all()
    names = tuple(f"t{i}" for i in range(3))
    view = eng.store.view
    ids = rng.integers(0, 1000, int(length.sum()))
    b = prepare(eng.spec, layout, names, view, eng.slot_tables(view, names), eng.device,
                eng.dtype, ids=ids)
    dense = [g for g in b.attn if g.rows is None]
    assert dense and sum(g.n for g in dense) == len(tenant)  # every request attends through a view
    with pytest.raises(ValueError, match="packed"):
        plan("packed", tenant, length).view(x, 0)


def test_plan_cli_reports_every_strategy(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "itif",
            "plan",
            "--backbone",
            "bert-tiny",
            "--workload",
            "normal:20:20",
            "--tenants",
            "3",
            "--requests",
            "24",
            "--skew",
            "zipf:1.5",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ},
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert set(report["strategies"]) == set(STRATEGIES)
    for name, row in report["strategies"].items():
        assert set(row) == {"padded_tokens", "useful_tokens", "predicted_ms", "measured_ms",
                            "plan_us_per_request", "gemm_calls"}
        assert row["measured_ms"] > 0 and row["gemm_calls"] > 0
    assert report["strategies"]["packed"]["padded_tokens"] == 0
    # tenants that draw no request (more tenants than requests): planned with the batch's own
    # tenant indices, as the engine's forward numbers them (before: IndexError, "UNKNOWN")
    few = subprocess.run(
        [sys.executable, "-m", "itif", "plan", "--backbone", "bert-tiny", "--tenants", "50",
         "--requests", "3", "--json"],
        capture_output=True, text=True, timeout=300)
    assert few.returncode == 0, few.stderr
    assert json.loads(few.stdout)["strategies"]["packed"]["measured_ms"] > 0
    bad = subprocess.run([sys.executable, "-m", "itif", "plan", "--workload", "zipf:3"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and bad.stderr.startswith("error: INVALID_ARGUMENT: ")
