"""The dispatcher: backend choice, reasons, and the errors when a named backend refuses."""

import pytest
import torch

import qkv
from qkv import dispatch
from qkv.ops import AttentionCall, BackendResult, BackendUnsupportedError, torch_sdpa


class Float32Only:
    """A backend faster than every other that only takes float32: tests the mechanism."""

    name = "f32only"
    priority = 0

    def __init__(self):
        self.calls = 0

    def supports(self, call):
        if call.dtype != torch.float32:
            return f"needs float32 inputs, got {call.dtype}"
        return None

    def run(self, call):
        self.calls += 1
        return dispatch.get_backend("reference").run(call)


@pytest.fixture
def f32only():
    backend = Float32Only()
    dispatch.register_backend(backend)
    yield backend
    assert dispatch.unregister_backend(backend.name) is backend
    assert "f32only" not in qkv.backend_names()


def _qkv(dtype=torch.float32):
    return [torch.randn(2, 4, 9, 8, dtype=dtype) for _ in range(3)]


def test_backend_names_fastest_first():
    assert qkv.backend_names() == ["torch", "flex", "triton", "tiled", "reference"]


def test_auto_takes_fastest_that_supports(f32only):
    qkv.scaled_dot_product_attention(*_qkv(torch.float32))
    assert f32only.calls == 1
    q, k, v = _qkv(torch.float64)  # a gradient is wanted: a kernel (and weights from its lse)
    _, trace = qkv.scaled_dot_product_attention(q.requires_grad_(), k, v, return_trace=True)
    assert f32only.calls == 1 and trace.backend == "torch"


def test_named_backend_refuses_with_reason(f32only):
    with pytest.raises(
        BackendUnsupportedError,
        match=r"backend 'f32only' cannot take this call: needs float32 inputs, got "
        r"torch.float64\. Backends that can: torch, tiled, reference; or pass "
        r"backend='auto'",
    ):
        qkv.scaled_dot_product_attention(*_qkv(torch.float64), backend="f32only")
    assert issubclass(BackendUnsupportedError, ValueError)


def test_check_backends_reports_every_answer(f32only):
    call = AttentionCall.build(*_qkv(torch.float64))
    answers = dispatch.check_backends(call)
    on_cpu = call.device.type == "cpu"  # (QKV_TEST_DEVICE=cuda runs this on a GPU)
    assert ("CUDA" if on_cpu else "float64") in answers.pop("triton")  # CUDA, not float64
    assert "float64" in answers.pop("flex")  # compiled Flex: half precision and float32
    assert answers == {
        "f32only": "needs float32 inputs, got torch.float64",
        "torch": None,
        "tiled": None,
        "reference": None,
    }


def test_register_rejects_duplicates_and_auto():
    with pytest.raises(ValueError, match="already registered"):
        dispatch.register_backend(dispatch.get_backend("torch"))

    class Auto(Float32Only):
        name = "auto"

    with pytest.raises(ValueError, match="'auto' is the dispatcher's own choice"):
        dispatch.register_backend(Auto())


def test_trace_uses_kernel_lse_when_it_fits(monkeypatch):
    """A 4-D CPU call takes out and lse from torch's flash kernel in one run, with no second
    SDPA call; a GQA call too (its kv heads repeated per query head); without a trace,
    plain torch SDPA. (q requires grad: without, auto forms output and weights in one pass.)"""
    if torch.empty(0).device.type != "cpu":
        pytest.skip("the CPU flash kernel's lse: a CPU call (QKV_TEST_DEVICE is not cpu)")
    seen = []
    real = torch_sdpa.flash_forward
    monkeypatch.setattr(
        torch_sdpa, "flash_forward", lambda *a, **kw: seen.append(1) or real(*a, **kw)
    )
    q, k, v = _qkv()
    q.requires_grad_()
    _, trace = qkv.scaled_dot_product_attention(q, k, v, return_trace=True)
    assert seen == [1]
    out, trace = qkv.scaled_dot_product_attention(
        q, k[:, :2], v[:, :2], enable_gqa=True, return_trace=True
    )
    assert seen == [1, 1]
    ref, ref_trace = qkv.scaled_dot_product_attention(
        q, k[:, :2], v[:, :2], enable_gqa=True, return_trace=True, backend="reference"
    )
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(trace.lse, ref_trace.lse)
    torch.testing.assert_close(trace.probs, ref_trace.probs)
    qkv.scaled_dot_product_attention(q, k, v)  # no trace: plain torch SDPA
    assert seen == [1, 1]


def test_backend_result_needs_only_out():
    assert BackendResult(out=torch.zeros(1)).lse is None
