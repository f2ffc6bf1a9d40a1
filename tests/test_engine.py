"""The fused engine against Hugging Face, request by request (float32, CPU, max abs diff 1e-4)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import itif
from itif.batching.strategies import STRATEGIES
from tests.oracle import make_hf_model, max_diff, random_request, reference

TOL = 1e-4
FAMILIES = ["bert-tiny", "albert-tiny", "vit-tiny"]


def _engine_with(preset, models: dict, **kw) -> itif.Engine:
    eng = itif.Engine(preset, **kw)
    for name, m in models.items():
        eng.add_tenant(name, m.state_dict())
    return eng


def _check(eng, models, requests, strategy=None):
    results = eng.infer(requests, strategy=strategy)
    assert len(results) == len(requests)
    for i, (res, req) in enumerate(zip(results, requests)):
        assert res.tenant == req.tenant
        ref = reference(models[req.tenant], req)
        for name in req.outputs:
            assert getattr(res, name) is not None, (i, name)
        d = max_diff(res, ref)
        assert d <= TOL, f"request {i} of {req.tenant}: max abs diff {d:.3g}"
    return results


@pytest.mark.parametrize("preset", FAMILIES)
@pytest.mark.parametrize("mix", ["distinct", "same_backbone", "skewed"])
def test_fused_equals_hf_per_request(preset, mix, hf_factory):
    rng = np.random.default_rng(zlib.crc32(f"{preset}/{mix}".encode()))  # not hash(): per process
    if mix == "distinct":
        models = {f"d{i}": hf_factory(preset, 2 + i, seed=i) for i in range(4)}
    elif mix == "same_backbone":  # identical but for the head
        base = hf_factory(preset, 3, seed=0)
        models = {
            f"h{i}": make_hf_model(preset, 2 + i, seed=10 + i, base_of=base) for i in range(4)
        }
    else:  # skewed: one tenant sends most requests
        models = {f"s{i}": hf_factory(preset, 2, seed=20 + i) for i in range(3)}
    eng = _engine_with(preset, models)
    names = list(models)
    if mix == "skewed":
        tenants = [names[0]] * 9 + names[1:]
    else:
        tenants = [names[i % len(names)] for i in range(10)]
    spec = eng.spec
    reqs = [random_request(spec, t, rng) for t in tenants]
    if spec.is_text:  # the extremes of length: 1 and the backbone's maximum
        reqs[0] = random_request(spec, tenants[0], rng, length=1)
        reqs[1] = random_request(spec, tenants[1], rng, length=spec.max_position)
    _check(eng, models, reqs)


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_every_strategy_equals_hf(strategy, hf_factory):
    models = {f"t{i}": hf_factory("bert-tiny", 3, seed=i) for i in range(3)}
    eng = _engine_with("bert-tiny", models)
    rng = np.random.default_rng(7)
    reqs = [random_request(eng.spec, f"t{i % 3}", rng, length=int(rng.integers(1, 60)))
            for i in range(12)]
    _check(eng, models, reqs, strategy=strategy)


@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_mixes_equal_hf(data, hf_factory):
    """Property: any mix of 2-8 tenants, any request counts and lengths, any strategy."""
    preset = data.draw(st.sampled_from(["bert-tiny", "albert-tiny"]))
    n_tenants = data.draw(st.integers(2, 8))
    models = {f"p{i}": hf_factory(preset, 1 + i % 4, seed=100 + i) for i in range(n_tenants)}
    eng = _engine_with(preset, models)
    counts = data.draw(st.lists(st.integers(0, 4), min_size=n_tenants, max_size=n_tenants)
                       .filter(lambda c: sum(c) > 0))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    reqs = []
    for i, c in enumerate(counts):
        for _ in range(c):
            L = data.draw(st.integers(1, eng.spec.max_position))
            reqs.append(random_request(eng.spec, f"p{i}", rng, length=L))
    order = data.draw(st.permutations(range(len(reqs))))
    reqs = [reqs[i] for i in order]
    _check(eng, models, reqs, strategy=data.draw(st.sampled_from(sorted(STRATEGIES))))


def test_outputs_default_and_pooled(hf_factory):
    head = hf_factory("bert-tiny", 3, seed=1)
    base = hf_factory("bert-tiny", None, seed=2)
    eng = _engine_with("bert-tiny", {"cls": head, "emb": base})
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 1000, 17)
    r1, r2 = eng.infer([itif.Request("cls", ids), itif.Request("emb", ids)])
    assert r1.logits is not None and r1.logits.shape == (3,) and r1.pooled is None
    assert r2.pooled is not None and r2.pooled.shape == (64,) and r2.logits is None
    ref = reference(base, itif.Request("emb", ids))
    np.testing.assert_allclose(r2.pooled, ref["pooled"], atol=TOL)
    with pytest.raises(itif.InvalidRequest, match="no classification head"):
        eng.infer([itif.Request("emb", ids, outputs=("logits",))])


def test_vit_pooled_is_the_pooler_where_the_weights_carry_one(hf_factory):
    """ViT: ``pooled`` is tanh(dense(h_[CLS])) for a tenant with a pooler (an HF ViTModel), the
    [CLS] row for one without (ViTForImageClassification, whose classifier reads that row),
    in one batch; before, every ViT tenant's pooler was skipped (2.5 off on vit-tiny)."""
    models = {"emb": hf_factory("vit-tiny", None, seed=3), "cls": hf_factory("vit-tiny", 3, seed=4)}
    eng = _engine_with("vit-tiny", models)
    assert eng.tenant_info("emb").has_pooler and not eng.tenant_info("cls").has_pooler
    rng = np.random.default_rng(1)
    reqs = [random_request(eng.spec, "emb", rng, outputs=("pooled", "last_hidden_state")),
            random_request(eng.spec, "cls", rng, outputs=("logits", "pooled")),
            random_request(eng.spec, "emb", rng, outputs=("pooled",))]
    _check(eng, models, reqs)


def test_shared_backbone_holds_one_model_plus_heads(hf_factory):
    base = hf_factory("bert-tiny", 2, seed=3)
    models = {
        f"h{i}": make_hf_model("bert-tiny", 2 + i, seed=30 + i, base_of=base) for i in range(4)
    }
    one = itif.Engine("bert-tiny")
    one.add_tenant("only", base.state_dict())
    eng = _engine_with("bert-tiny", models)
    head_bytes = sum((2 + i) * (64 + 1) * 4 for i in range(4))
    base_head = 2 * 65 * 4
    assert eng.weight_bytes == one.weight_bytes - base_head + head_bytes
    info = eng.tenant_info("h0")
    assert info.bytes == one.weight_bytes  # each tenant reads a whole model...
    assert info.exclusive_bytes == 2 * 65 * 4  # ...but holds only its head alone
    # Shared layers run as one GEMM segment for all four tenants.
    rng = np.random.default_rng(1)
    reqs = [random_request(eng.spec, f"h{i}", rng, length=9) for i in range(4)]
    layout = eng.plan(np.arange(4), np.full(4, 9))
    tenants = eng.batch_tenants(eng.store.view, [r.tenant for r in reqs])
    from itif.runtime.batch import prepare

    view = eng.store.view
    b = prepare(eng.spec, layout, tenants, view, eng.slot_tables(view, tenants), eng.device,
                eng.dtype, ids=np.concatenate([r.input_ids for r in reqs]))
    _, segs = b.params.segments("layers.0.qkv.weight")
    assert len(segs) == 1 and segs.start == (0,) and segs.end == (36,)
    _check(eng, models, reqs)


def test_remove_frees_slots_and_readd_is_identical(hf_factory):
    models = {"a": hf_factory("bert-tiny", 2, seed=41), "b": hf_factory("bert-tiny", 2, seed=42)}
    eng = _engine_with("bert-tiny", models)
    rng = np.random.default_rng(3)
    req = random_request(eng.spec, "b", rng, length=20)
    before = eng.infer([req])[0]
    both = eng.weight_bytes
    eng.remove_tenant("b")
    assert eng.weight_bytes == both // 2
    assert "b" not in eng.tenants()
    with pytest.raises(itif.TenantNotFound):
        eng.infer([req])
    eng.add_tenant("b", models["b"].state_dict())
    assert eng.weight_bytes == both
    assert eng.store.reserved_bytes <= 2 * both  # freed slots were reused, not grown again
    after = eng.infer([req])[0]
    np.testing.assert_array_equal(before.logits, after.logits)
    np.testing.assert_array_equal(before.last_hidden_state, after.last_hidden_state)


def test_replacing_weights_is_atomic_and_frees_old(hf_factory):
    a1, a2 = hf_factory("bert-tiny", 2, seed=51), hf_factory("bert-tiny", 2, seed=52)
    eng = _engine_with("bert-tiny", {"a": a1})
    one = eng.weight_bytes
    eng.add_tenant("a", a2.state_dict())
    assert eng.weight_bytes == one
    rng = np.random.default_rng(4)
    _check(eng, {"a": a2}, [random_request(eng.spec, "a", rng, length=11)])


def test_freed_slot_not_reused_while_old_snapshot_is_read(hf_factory):
    a, b, c = (hf_factory("bert-tiny", 2, seed=s) for s in (61, 62, 63))
    eng = _engine_with("bert-tiny", {"a": a, "b": b})
    with eng.store.read() as old_view:  # an in-flight forward holding the old snapshot
        buf, slot_b = old_view.param("b", "layers.0.qkv.weight")
        snapshot = buf[slot_b].clone()
        eng.remove_tenant("b")
        eng.add_tenant("c", c.state_dict())
        assert torch.equal(buf[slot_b], snapshot)  # b's slot was not overwritten under us
    eng.add_tenant("d", hf_factory("bert-tiny", 2, seed=64).state_dict())  # now it may be
    assert set(eng.tenants()) == {"a", "c", "d"}


def test_bad_requests_are_clear_errors(hf_factory):
    eng = _engine_with("bert-tiny", {"a": hf_factory("bert-tiny", 2, seed=1)})
    cases = [
        (itif.Request("a", [1, 2, 1000]), "outside the vocabulary"),
        (itif.Request("a", [-1]), "outside the vocabulary"),
        (itif.Request("a", []), "length 0"),
        (itif.Request("a", list(range(129))), "length 129"),
        (itif.Request("a", [[1, 2]]), "1-D"),
        (itif.Request("a", [1.5, 2.0]), "integers"),
        (itif.Request("a", [1, 2], token_type_ids=[0]), "token_type_ids"),
        (itif.Request("a", [1, 2], token_type_ids=[0, 5]), "token_type_ids"),
        (itif.Request("a", [1, 2], outputs=("bogus",)), "unknown output"),
        (itif.Request("a"), "input_ids is required"),
        (itif.Request("a", pixel_values=np.zeros((3, 32, 32))), "not pixel_values"),
    ]
    for req, msg in cases:
        with pytest.raises(itif.InvalidRequest, match=msg):
            eng.infer([itif.Request("a", [1, 2]), req])
    with pytest.raises(itif.TenantNotFound):
        eng.infer([itif.Request("nobody", [1])])
    assert eng.infer([itif.Request("a", [1, 2])])[0].logits.shape == (2,)  # still serving


def test_bad_pixels_are_clear_errors(hf_factory):
    eng = _engine_with("vit-tiny", {"v": hf_factory("vit-tiny", 2, seed=1)})
    with pytest.raises(itif.InvalidRequest, match="shape"):
        eng.infer([itif.Request("v", pixel_values=np.zeros((3, 16, 16)))])
    with pytest.raises(itif.InvalidRequest, match="NaN"):
        eng.infer([itif.Request("v", pixel_values=np.full((3, 32, 32), np.nan))])
    with pytest.raises(itif.InvalidRequest, match="not input_ids"):
        eng.infer([itif.Request("v", input_ids=[1, 2])])
    # one non-finite value anywhere in a batch is found, and its request named
    rng = np.random.default_rng(0)
    good = rng.standard_normal((3, 32, 32)).astype(np.float32)
    for bad_value, at in ((np.inf, (0, 0, 0)), (-np.inf, (2, 31, 31)), (np.nan, (1, 7, 9))):
        bad = good.copy()
        bad[at] = bad_value
        with pytest.raises(itif.InvalidRequest, match=r"request 2: .*NaN or Inf"):
            eng.infer([itif.Request("v", pixel_values=good)] * 2
                      + [itif.Request("v", pixel_values=bad)])
    # other numeric dtypes are read as float32, as a float32 request is
    want = eng.infer([itif.Request("v", pixel_values=good)])[0].logits
    for px in (good.astype(np.float64), good.tolist()):
        np.testing.assert_array_equal(eng.infer([itif.Request("v", pixel_values=px)])[0].logits,
                                      want)
    ints = np.arange(3 * 32 * 32, dtype=np.int64).reshape(3, 32, 32) % 5
    np.testing.assert_array_equal(
        eng.infer([itif.Request("v", pixel_values=ints)])[0].logits,
        eng.infer([itif.Request("v", pixel_values=ints.astype(np.float32))])[0].logits)


def test_a_result_names_the_weights_that_produced_it_across_a_replacement():
    """``Result.weights`` is the tag of the tenant's weights in the store snapshot the forward
    ran on. The daemon answered ``weights_sha256`` with the tenant's sha read after the forward,
    so a re-upload that finished while the forward ran labelled the old weights' outputs with
    the new sha (an audit: 64 of 64 rows). Here the replacement lands inside the forward."""
    eng = itif.Engine("bert-tiny")
    old, new = make_hf_model("bert-tiny", 3, seed=1), make_hf_model("bert-tiny", 3, seed=2)
    eng.add_tenant("a", {k: v for k, v in old.state_dict().items()}, tag="sha-old")
    req = random_request(eng.spec, "a", np.random.default_rng(0), outputs=("logits",))
    run, replaced = eng._run, []

    def replacing_run(view, *args):  # the snapshot is taken; the upload completes meanwhile
        if not replaced:
            replaced.append(eng.add_tenant("a", {k: v for k, v in new.state_dict().items()},
                                           tag="sha-new"))
        return run(view, *args)

    eng._run = replacing_run
    (during,) = eng.infer([req])
    assert during.weights == "sha-old" and max_diff(during, reference(old, req)) < 1e-4
    (after,) = eng.infer([req])
    assert after.weights == "sha-new" and max_diff(after, reference(new, req)) < 1e-4


def test_a_given_layout_runs_instead_of_planning_and_on_plan_sees_the_batchs(hf_factory,
                                                                          monkeypatch):
    """``infer(layout=)`` (the calibration's timed layouts) runs that plan, never ``plan``;
    ``on_plan`` (the daemon's padding metric) receives the layout the batch ran, planned or
    given; outputs equal Hugging Face's either way."""
    models = {f"g{i}": hf_factory("bert-tiny", 2, seed=40 + i) for i in range(2)}
    eng = _engine_with("bert-tiny", models)
    rng = np.random.default_rng(7)
    requests = [random_request(eng.spec, f"g{i % 2}", rng) for i in range(5)]
    seen = []
    planned = _check_on_plan(eng, models, requests, seen)
    monkeypatch.setattr(eng, "plan", lambda *a, **k: pytest.fail("planned despite a layout"))
    again = eng.infer(requests, layout=planned, on_plan=seen.append)
    assert seen == [planned, planned]
    for res, req in zip(again, requests):
        assert max_diff(res, reference(models[req.tenant], req)) <= TOL


def _check_on_plan(eng, models, requests, seen):
    results = eng.infer(requests, on_plan=seen.append)
    (layout,) = seen
    assert layout.total_rows >= sum(len(r.input_ids) for r in requests)
    for res, req in zip(results, requests):
        assert max_diff(res, reference(models[req.tenant], req)) <= TOL
    return layout
