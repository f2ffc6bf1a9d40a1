"""Contracts said once (issue #64 item 3), in the form of Punica's ops (CPU, fast).

- every op class of ``itif.ops.dispatch`` and every GEMM entry point (``run_gemm``,
  ``apply_lora``, the Triton GEMM, the grouped cuBLAS call, the CUDA ``masked_softmax`` step)
  has a docstring with a ``Semantics:`` line in index notation and an ``Args:`` entry for each
  parameter it takes, no more: ``Shape:``, ``DType:`` and in place or read only for a tensor,
  ``Type:`` for anything else;
- an op's parameters are declared once, by its torch reference: ``dispatch`` defines no
  function of its own for an op (the name is an instance of the op's class, whose signature is
  the reference's), the CUDA wrapper of an op takes exactly the reference's parameters and
  does not restate the contract, and its validators take them in the same order;
- what a contract says about writes holds: the reference leaves each "Read only" argument as it
  was and returns the "Written in place and returned" one itself;
- calling an op hands both forwards every argument positionally, defaults filled in;
- the GEMM modules and the CUDA wrappers read no other object's private members.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest
import torch

from itif.ops import cuda, dispatch, reference, validate
from itif.ops.reference import AttnGroup, RotParam
from itif.runtime import cublas_grouped, gemm, lora_update, triton_gemm

REPO = Path(__file__).resolve().parents[1]

#: The GEMM entry points and the op step without a class: each carries its contract itself.
ENTRY_POINTS = {
    "gemm.run_gemm": gemm.run_gemm,
    "lora_update.apply_lora": lora_update.apply_lora,
    "triton_gemm.run": triton_gemm.run,
    "cublas_grouped.run": cublas_grouped.run,
    "cuda.masked_softmax": cuda.masked_softmax,
}
OP_CLASSES = {type(op).__name__: type(op) for op in dispatch.ALL_OPS}


def _args_section(doc: str) -> dict[str, str]:
    """``name -> its entry`` of a docstring's ``Args:`` section (continuation lines joined)."""
    lines = inspect.cleandoc(doc).splitlines()
    assert "Args:" in lines, "no 'Args:' section"
    entries: dict[str, str] = {}
    name = None
    for line in lines[lines.index("Args:") + 1:]:
        if not line.strip() or not line.startswith("    "):
            break
        m = re.match(r"^    (\w+): (.*)$", line)
        if m:
            name = m.group(1)
            assert name not in entries, f"{name} has two entries"
            entries[name] = m.group(2)
        else:
            assert name is not None and line.startswith("        "), f"stray line {line!r}"
            entries[name] += " " + line.strip()
    return entries


def _contract_problems(doc: str | None, params: list[str]) -> list[str]:
    """What a docstring lacks of the contract form, for a callable taking ``params``."""
    if not doc:
        return ["no docstring"]
    lines = inspect.cleandoc(doc).splitlines()
    if "Semantics:" not in lines:
        return ["no 'Semantics:' line"]
    formula = lines[lines.index("Semantics:") + 1]
    out = []
    if not (formula.startswith("    ") and re.search(r"\w\[[^\]]*\bt\b", formula)):
        out.append(f"the Semantics line is not in index notation over rows t: {formula!r}")
    try:
        entries = _args_section(doc)
    except AssertionError as e:
        return out + [str(e)]
    if sorted(entries) != sorted(params):
        out.append(f"Args name {sorted(entries)}, the parameters are {sorted(params)}")
    for name, text in entries.items():
        tensor = "Shape:" in text
        if tensor and not ("DType:" in text and ("Read only" in text or "in place" in text)):
            out.append(f"{name}: a tensor entry needs Shape, DType and in place / read only")
        if not tensor and "Type:" not in text:
            out.append(f"{name}: needs 'Shape:' (a tensor) or 'Type:' (anything else)")
    return out


@pytest.mark.parametrize("name", sorted(OP_CLASSES))
def test_every_op_class_states_its_contract(name):
    cls = OP_CLASSES[name]
    params = list(inspect.signature(cls.forward_reference).parameters)
    assert _contract_problems(cls.__doc__, params) == []


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_every_gemm_entry_point_states_its_contract(name):
    fn = ENTRY_POINTS[name]
    assert _contract_problems(fn.__doc__, list(inspect.signature(fn).parameters)) == []


def test_the_contract_checker_finds_what_is_missing():
    good = """Adds.

    Semantics:
        x[t, n] += b[slot[t], n]

    Args:
        x: Shape: [T, N]. DType: float. Written in place and returned.
        b: Shape: [C, N]. DType: x's. Read only.
        slot: Shape: [T]. DType: int64. Read only.
    """
    assert _contract_problems(good, ["x", "b", "slot"]) == []
    assert _contract_problems(good, ["x", "b", "slot", "act"]) == [
        "Args name ['b', 'slot', 'x'], the parameters are ['act', 'b', 'slot', 'x']"]
    assert _contract_problems(good.replace(" Read only.", ""), ["x", "b", "slot"]) == [
        "b: a tensor entry needs Shape, DType and in place / read only",
        "slot: a tensor entry needs Shape, DType and in place / read only"]
    assert _contract_problems(
        good.replace("x[t, n] += b[slot[t], n]", "x += b"), ["x", "b", "slot"]
    )[0].startswith("the Semantics line is not in index notation")
    assert _contract_problems("``y = x @ w.T``. x: [rows, K]", ["x"]) == ["no 'Semantics:' line"]
    assert _contract_problems(None, []) == ["no docstring"]


# ---- parameters declared once ---------------------------------------------------------------


def test_dispatch_declares_no_op_function_of_its_own():
    tree = ast.parse((REPO / "itif/ops/dispatch.py").read_text(encoding="utf-8"))
    defs = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    names = {op.name for op in dispatch.ALL_OPS}
    assert not defs & names, f"dispatch declares these ops again: {sorted(defs & names)}"
    for op in dispatch.ALL_OPS:
        assert getattr(dispatch, op.name) is op
        assert op.forward_reference is getattr(reference, op.name)
        assert inspect.signature(op) == inspect.signature(op.forward_reference)
        assert op.__doc__ == type(op).__doc__  # help(dispatch.bias_act) shows the contract


def test_ops_with_kernels_are_the_ops_dispatch_runs_on_cuda():
    assert dispatch.OPS == tuple(op.name for op in dispatch.ALL_OPS if op.has_kernel)
    assert dispatch.OPS == ("bias_act", "bias_residual", "bias_residual_layernorm", "embed_text",
                            "attention")


@pytest.mark.parametrize("name", dispatch.OPS)
def test_each_cuda_wrapper_takes_the_reference_parameters_and_no_contract(name):
    wrapper, ref = getattr(cuda, name), getattr(reference, name)
    assert inspect.signature(wrapper) == inspect.signature(ref)
    doc = wrapper.__doc__ or ""
    assert "Semantics:" not in doc and "Shape:" not in doc, "the contract is the op class's"
    assert f"dispatch.{type(getattr(dispatch, name)).__name__}" in doc, "name the op's class"


@pytest.mark.parametrize("name", dispatch.OPS)
def test_each_kernel_validator_takes_the_reference_parameters_in_order(name):
    ref = list(inspect.signature(getattr(reference, name)).parameters)
    check = list(inspect.signature(getattr(validate, f"validate_{name}")).parameters)
    sig = list(inspect.signature(getattr(validate, f"sig_{name}")).parameters)
    assert check[-1] == "require_cuda" and check[:-1] == ref[: len(check) - 1]
    assert sig == check[:-1]


# ---- the contracts' writes hold -------------------------------------------------------------


def _rot(buf: torch.Tensor, T: int) -> RotParam:
    return RotParam(buf, torch.arange(T) % buf.shape[0])


def _cases() -> dict[str, tuple]:
    g = torch.Generator().manual_seed(0)
    T, H, C = 6, 8, 3

    def r(*shape):
        return torch.randn(*shape, generator=g)

    qkv = r(T, 3 * H)
    cos, sin = r(T, 4), r(T, 4)
    return {
        "bias_act": (r(T, H), _rot(r(C, H), T), "gelu"),
        "bias_residual": (r(T, H), _rot(r(C, H), T), r(T, H)),
        "bias_residual_layernorm": (r(T, H), _rot(r(C, H), T), r(T, H), _rot(r(C, H), T),
                                    _rot(r(C, H), T), 1e-5, False),
        "embed_text": (_rot(r(C, 10, H), T), _rot(r(C, 10, H), T), _rot(r(C, 2, H), T),
                       torch.arange(T) % 10, torch.arange(T), torch.arange(T) % 2),
        "attention": (qkv, [AttnGroup(n=2, L=3)], 2, torch.zeros(T, H), None),
        "rms_norm": (r(T, H), r(T, H), _rot(r(C, H), T), 1e-6, False),
        "rotary": (r(T, 2 * 4), cos, sin, 2),
        "gated_act": (r(T, 2 * H), "silu"),
    }


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, RotParam):
        return [value.buf, value.slot]
    return []


@pytest.mark.parametrize("name", [op.name for op in dispatch.ALL_OPS])
def test_the_reference_writes_what_the_contract_says(name):
    op = getattr(dispatch, name)
    args = _cases()[name]
    params = list(inspect.signature(op).parameters)
    entries = _args_section(type(op).__doc__)
    before = {p: [t.clone() for t in _tensors(a)] for p, a in zip(params, args)}
    got = op(*args)
    for p, a in zip(params, args):
        if "Read only" in entries[p] and "keep_sum" not in entries[p]:
            assert all(torch.equal(t, b) for t, b in zip(_tensors(a), before[p])), (
                f"{name} wrote its read-only argument {p}")
        if "Written in place and returned" in entries[p]:
            assert got is a, f"{name} did not return its in-place argument {p}"


# ---- one dispatch -----------------------------------------------------------------------------


class _Recorder:
    """A stand-in CUDA backend: records each call's positional arguments, runs the reference."""

    KernelBuildError = RuntimeError

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []

    def __getattr__(self, name):
        def call(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            return getattr(reference, name)(*args, **kwargs)

        return call


def test_an_op_hands_its_forwards_every_argument_positionally(monkeypatch):
    be = _Recorder()
    monkeypatch.setattr(dispatch, "_backend_for", lambda t: be)
    x, bias, res, gamma, beta, *_ = _cases()["bias_residual_layernorm"]
    y = dispatch.bias_residual_layernorm(x, bias, residual=res, gamma=gamma, beta=beta, eps=1e-5)
    assert be.calls == [("bias_residual_layernorm", (x, bias, res, gamma, beta, 1e-5, False), {})]
    torch.testing.assert_close(y, reference.bias_residual_layernorm(x, bias, res, gamma, beta,
                                                                    1e-5))
    be.calls.clear()
    dispatch.bias_act(x=x.clone(), bias=bias)
    assert [(n, len(a), a[2]) for n, a, _ in be.calls] == [("bias_act", 3, "none")]
    with pytest.raises(TypeError, match="colour"):
        dispatch.bias_act(x, bias, colour="red")
    with pytest.raises(TypeError, match="bias"):
        dispatch.bias_act(x)
    with pytest.raises(TypeError, match="multiple values"):
        dispatch.bias_act(x, bias, x=x)
    be.calls.clear()
    dispatch.gated_act(torch.randn(2, 8))  # no kernel: the backend is never asked
    assert be.calls == []


# ---- private members --------------------------------------------------------------------------

#: The files this rule holds for so far (issue #64 item 2 extends it to the rest).
NO_PRIVATE_READS = ["itif/runtime/gemm.py", "itif/runtime/triton_gemm.py",
                    "itif/runtime/lora_update.py", "itif/runtime/cublas_grouped.py",
                    "itif/ops/cuda.py", "itif/ops/dispatch.py"]


def _private_reads(src: str) -> list[str]:
    """``x._y`` where x is not self or cls (dunders aside)."""
    return [ast.unparse(n) for n in ast.walk(ast.parse(src))
            if isinstance(n, ast.Attribute) and n.attr.startswith("_")
            and not n.attr.startswith("__")
            and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"))]


def test_private_read_finder():
    assert _private_reads("a._b; self._c; cls._d; a.__e; a.b._c") == ["a._b", "a.b._c"]


@pytest.mark.parametrize("rel", NO_PRIVATE_READS)
def test_no_private_reads_of_other_objects(rel):
    assert _private_reads((REPO / rel).read_text(encoding="utf-8")) == []
