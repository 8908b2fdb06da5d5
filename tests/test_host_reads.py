"""No host reads on the hot path (issue 38, DESIGN "No host reads on the hot path, eager too").

On CUDA every op that moves a tensor's value to the host is a device sync. On CPU the same
ops are counted here under a ``TorchDispatchMode``: ``_local_scalar_dense`` (``.item()``,
``float(t)``, ``bool(t)``, ``if t:``), ``is_nonzero``, ``equal``/``allclose``, and the ops whose
output shape depends on values (``nonzero``, ``masked_select``, ``unique``, a bool index,
``repeat_interleave`` without ``output_size``, ``bincount``, ...). ``Tensor.tolist`` and
``Tensor.numpy`` read memory without dispatching an op: they are counted by wrapping them.

Each eager path runs twice with the same structure (fresh tensors of the same shapes); the
first call may read (it plans and caches), the second must read nothing, forward and
forward + backward.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable

import pytest
import torch
from conftest import TEST_DEVICE
from routes import force_host_reads, force_native_rows
from torch.utils._python_dispatch import TorchDispatchMode

import qkv
from qkv import masks

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def _reads_as_on_cuda(monkeypatch):
    """Every call runs the way it runs by default and on CUDA, where a read is a sync, whatever
    ``QKV_CPU_HOST_READS`` says in the environment; the CPU's opt-in reads (tests/routes.py)
    are counted in ``test_an_inference_call_on_the_cpu_reads_two_sums``."""
    force_host_reads(monkeypatch, free=False)


# Ops whose result is a value read on the host, whatever their arguments.
_READS = {
    aten._local_scalar_dense.default,
    aten.is_nonzero.default,
    aten.equal.default,
    aten.allclose.default,
    aten.nonzero.default,
    aten.argwhere.default,
    aten.masked_select.default,
    aten._unique.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.bincount.default,
    aten.histc.default,
}


def _on_host_only(args, kwargs) -> bool:
    """Whether every tensor the op reads is on the CPU while the suite runs elsewhere
    (``QKV_TEST_DEVICE=cuda``): host-side bookkeeping made on the CPU on purpose (a trace's
    row indices), whose reads wait for no device. On the CPU every read counts: there the
    suite cannot tell a tensor that would be on the GPU from one that would stay."""
    if TEST_DEVICE == "cpu":
        return False
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    return bool(tensors) and all(t.device.type == "cpu" for t in tensors)


def _is_read(func, args, kwargs) -> bool:
    """Whether one dispatched op reads a value on the host."""
    if _on_host_only(args, kwargs):
        return False
    if func in _READS:
        return True
    if func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor):
        return kwargs.get("output_size") is None  # else the output's size is a sum of values
    if func.overloadpacket in (aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(  # a bool index is a nonzero()
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices
        )
    return False


class HostReads(TorchDispatchMode):
    """Counts the host reads of the ops run under it; ``reads`` lists their names."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    # FlexAttention's operator (auto's choice for windows and documents on CUDA) comes here
    # whole: it runs as it is, its own ops uncounted
    supports_higher_order_operators = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if _is_read(func, args, kwargs):
            self.reads.append(str(func))
        return func(*args, **kwargs)


def _names_cpu(args, kwargs) -> bool:
    """Whether a ``Tensor.to`` call names the host by a string or ``torch.device("cpu")``
    (``.to(other.device)`` is a copy to the call's own device, not counted)."""
    for a in list(args[:1]) + [kwargs.get("device")]:
        if isinstance(a, str) and a.startswith("cpu"):
            return True
    return False


def count_reads(fn: Callable[[], object]) -> list[str]:
    """The host reads ``fn()`` makes (op names, in order): the ops above, and ``.tolist()``,
    ``.numpy()``, ``.cpu()`` and ``.to("cpu")`` (copies to the host, whatever device the
    tensor is on: on CUDA they sync)."""
    mode = HostReads()
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy", "cpu", "to")}

    inside = [False]  # (under a default device, torch's function mode calls the method again)

    def counted(name, orig):
        def wrapper(self, *args, **kwargs):
            if inside[0]:
                return orig(self, *args, **kwargs)
            if name != "to" or _names_cpu(args, kwargs):
                mode.reads.append(f"Tensor.{name}")
            inside[0] = True
            try:
                return orig(self, *args, **kwargs)
            finally:
                inside[0] = False

        return wrapper

    with pytest.MonkeyPatch.context() as mp:
        for name, orig in originals.items():
            mp.setattr(torch.Tensor, name, counted(name, orig))
        with mode:
            fn()
    return mode.reads


# --- the paths --------------------------------------------------------------------------------

B, H, T, S, D = 2, 4, 97, 97, 16
KINDS = [
    "plain",
    "causal",
    "bool_mask",
    "float_mask",
    "window",
    "document",
    "key_lengths",
    "padded_causal",
    "left_padded_window",
    "prefix_lm",
    "neighborhood",
    "sinks",
    "trace",
]
# backends that take each kind (torch's SDPA has no sinks; it takes a mask_mod as a dense mask)
_TAKES = {"torch": set(KINDS) - {"sinks"}}


def _structure(kind: str) -> dict:
    """The call's arguments besides q, k, v: its structure, made once and shared by the calls
    of a path, as a model shares one mask between its layers and steps."""
    g = torch.Generator().manual_seed(1)
    if kind == "causal":
        return {"is_causal": True}
    if kind == "bool_mask":
        return {"attn_mask": torch.rand(T, S, generator=g) < 0.7}
    if kind == "float_mask":
        bias = torch.randn(T, S, generator=g)
        return {"attn_mask": bias.masked_fill(torch.rand(T, S, generator=g) > 0.7, float("-inf"))}
    if kind == "window":
        return {"mask_mod": masks.sliding_window(16)}
    if kind == "document":
        ids = torch.repeat_interleave(torch.arange(3), torch.tensor([30, 40, 27]))  # (T,)
        return {"mask_mod": masks.document(ids.expand(B, T))}
    if kind == "key_lengths":
        return {"mask_mod": masks.key_lengths(torch.tensor([50, 97]))}
    if kind == "padded_causal":  # each element on its own keys (tiled: plan._batch_pieces)
        return {"mask_mod": masks.key_lengths(torch.tensor([50, 97])), "is_causal": True}
    if kind == "left_padded_window":  # a bool key mask (B, 1, 1, S), as transformers pads
        keep = torch.arange(S) >= torch.tensor([[0], [30]])  # (B, S)
        return {"attn_mask": keep[:, None, None, :], "mask_mod": masks.sliding_window(16)}
    if kind == "prefix_lm":  # torch: its causal kernel and the prefix again, no dense mask
        return {"mask_mod": masks.prefix_lm(20)}
    if kind == "neighborhood":  # T = 97 tokens in a 1D grid, in a shuffled order of its own
        order = torch.randperm(T, generator=g)
        return {"mask_mod": masks.neighborhood(9, T, dilation=2, layout=order)}
    if kind == "sinks":
        return {"sinks": torch.randn(H, generator=g)}
    if kind == "trace":
        return {"return_trace": True}
    return {}


def sdpa_path(kind: str, backend: str, grad: bool) -> Callable[[int], Callable[[], None]]:
    """``make(seed)``: a call of this path on fresh inputs (its structure shared)."""
    structure = _structure(kind)

    def make(seed: int) -> Callable[[], None]:
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(B, H, L, D, generator=g).requires_grad_(grad) for L in (T, S, S))

        def call() -> None:
            res = qkv.scaled_dot_product_attention(q, k, v, backend=backend, **structure)
            out = res[0] if isinstance(res, tuple) else res
            if grad:
                out.sum().backward()

        return call

    return make


def mha_path(variant: str, grad: bool) -> Callable[[int], Callable[[], None]]:
    """``make(seed)`` for the module: ``noweights``, ``weights`` (a trace), ``keymask`` (a
    padded batch), ``decode`` (one KV-cache step after a prompt), ``decode-keymask`` (the
    same, padded)."""
    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(H * D, H)
    decode = variant.startswith("decode")
    padded = variant.endswith("keymask")
    key_mask = torch.arange(T) < torch.tensor([[T], [T - 20]])  # (B, T): batch 1 padded
    cache = mha.new_cache(B, 2 * T) if decode else None
    if cache is not None:
        with torch.no_grad():
            mha(torch.randn(B, T, H * D), cache=cache, key_mask=key_mask if padded else None)
    step_mask = torch.ones(B, 1, dtype=torch.bool) if padded and decode else None

    def make(seed: int) -> Callable[[], None]:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(B, 1 if decode else T, H * D, generator=g)
        x.requires_grad_(grad)
        mask = step_mask if decode else key_mask if padded else None

        def call() -> None:
            with torch.set_grad_enabled(grad):
                res = mha(x, return_trace=variant == "weights", cache=cache, key_mask=mask)
            out = res[0] if isinstance(res, tuple) else res
            if grad:
                out.sum().backward()

        return call

    return make


def all_paths() -> dict[str, Callable[[], Callable[[int], Callable[[], None]]]]:
    """Every eager path by id (``window-tiled-fwd``, ``mha-weights-fwd+bwd``): a function that
    sets the path up and gives its ``make(seed)``."""
    paths = {}
    for kind in KINDS:
        for backend in ("auto", "tiled", "torch"):
            if backend in _TAKES and kind not in _TAKES[backend]:
                continue
            for grad in (False, True):
                name = f"{kind}-{backend}-{'fwd+bwd' if grad else 'fwd'}"
                paths[name] = functools.partial(sdpa_path, kind, backend, grad)
    for variant in ("noweights", "weights", "keymask"):
        for grad in (False, True):
            name = f"mha-{variant}-{'fwd+bwd' if grad else 'fwd'}"
            paths[name] = functools.partial(mha_path, variant, grad)
    for variant in ("decode", "decode-keymask"):
        paths[f"mha-{variant}-fwd"] = functools.partial(mha_path, variant, False)
    return paths


# --- the tests --------------------------------------------------------------------------------


def test_the_count_finds_every_kind_of_read():
    """Each way of reading a value on the host counts once (and a tensor op does not)."""
    x, b = torch.tensor([1.0, 0.0, 2.0]), torch.tensor([True, False, True])
    reads = {
        "item": lambda: x.sum().item(),
        "float": lambda: float(x[0]),
        "bool": lambda: bool(b.any()),
        "if": lambda: 1 if b.all() else 0,
        "equal": functools.partial(torch.equal, x, x),
        "allclose": functools.partial(torch.allclose, x, x),
        "nonzero": b.nonzero,
        "bool-index": lambda: x[b],
        "masked_select": lambda: x.masked_select(b),
        "unique": functools.partial(torch.unique, x),
        "repeat_interleave-tensor": lambda: x.repeat_interleave(torch.tensor([1, 2, 1])),
        "tolist": operator.methodcaller("tolist"),
        "numpy": operator.methodcaller("numpy"),
        "cpu": operator.methodcaller("cpu"),
        "to-cpu": lambda: x.to("cpu"),
    }
    if x.device.type != "cpu":
        del reads["numpy"]  # (a CUDA tensor has no numpy(): TypeError)
    for name, fn in reads.items():
        call = functools.partial(fn, x) if isinstance(fn, operator.methodcaller) else fn
        assert len(count_reads(call)) == 1, name
    ops = {
        "isfinite-all": lambda: torch.isfinite(x).all(),
        "where": lambda: torch.where(b, x, 0.0),
        "repeat_interleave-int": lambda: x.repeat_interleave(2),
        "repeat_interleave-sized": lambda: x.repeat_interleave(
            torch.tensor([1, 2, 1]), output_size=4
        ),
        "to-own-device": lambda: x.to(x.device),
    }
    for name, fn in ops.items():
        assert count_reads(fn) == [], name


@pytest.mark.parametrize("path", list(all_paths()))
def test_the_second_call_of_a_structure_reads_nothing_on_the_host(path, monkeypatch):
    """The first call of a structure may plan and remember; the second, on new q, k, v (and a
    new input to the module), reads no tensor value on the host, forward and backward."""
    if "padded" in path:  # each element on its own keys, however small (plan._worth_cutting)
        monkeypatch.setattr("qkv.ops.tiled.batch.PIECE_SCORES", 0)
    make = all_paths()[path]()
    count_reads(make(0))
    assert count_reads(make(1)) == []


@pytest.mark.parametrize(
    "kind, backend",
    [
        ("bool_mask", "tiled"),
        ("bool_mask", "torch"),
        ("float_mask", "torch"),
        ("document", "tiled"),
        ("document", "torch"),
        ("key_lengths", "tiled"),
        ("key_lengths", "torch"),
    ],
    ids=lambda x: x,
)
def test_a_mask_changed_in_place_between_calls_is_seen(kind, backend):
    """What the first call remembered of a mask (block plans, guards, sorted ids, content
    keys) is keyed by the mask tensor's version: changed in place, the next call follows it,
    equal to float64 math on the new mask, a NaN value in a newly hidden key included."""
    structure = _structure(kind)
    if kind == "document":  # ids of their own memory, to write into
        structure = {"mask_mod": masks.document(structure["mask_mod"].q_ids.clone())}
    if kind == "float_mask":  # in the inputs' dtype: the call takes the tensor as it is
        structure = {"attn_mask": structure["attn_mask"].double()}
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, H, L, D, generator=g, dtype=torch.float64) for L in (T, S, S))
    qkv.scaled_dot_product_attention(q, k, v, backend=backend, **structure)  # remembered
    with torch.no_grad():  # change the mask in place: hide key 5 from every row, show key 70
        if kind == "bool_mask":
            structure["attn_mask"][:, 5] = False
            structure["attn_mask"][:, 70] = True
        elif kind == "float_mask":
            structure["attn_mask"][:, 5] = float("-inf")
            structure["attn_mask"][:, 70] = 0.0
        elif kind == "document":
            structure["mask_mod"].q_ids[:, 5] = 7  # key 5 (and row 5) a document of its own
        else:
            structure["mask_mod"].n.fill_(5)  # keys 5.. padding in both batch elements
    v[:, :, 5] = float("nan")  # now hidden from every row but (for documents) its own
    out = qkv.scaled_dot_product_attention(q, k, v, backend=backend, **structure)
    call = qkv.ops.AttentionCall.build(q, k, v, **structure)
    ok = qkv.ops.nonfinite.allowed(call)  # (B, H, T, S)
    scores = q @ k.transpose(-2, -1) / D**0.5
    if kind == "float_mask":
        scores = scores + structure["attn_mask"]
    probs = torch.softmax(scores.masked_fill(~ok, float("-inf")), -1).nan_to_num(0.0)
    want = probs @ v.nan_to_num(0.0)  # (B, H, T, D)
    hit = ok[..., 5]  # rows that may attend key 5: NaN
    assert out[hit].isnan().all()
    torch.testing.assert_close(out[~hit], want[~hit])


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="a switch of CPU calls: the suite's are not")
@pytest.mark.parametrize("kind", ["causal", "bool_mask", "float_mask", "window", "document"])
def test_an_inference_call_on_the_cpu_reads_three_sums(monkeypatch, kind):
    """On the CPU with ``QKV_CPU_HOST_READS=1`` (a read there syncs nothing), a masked call
    without gradient runs on its inputs as they are and reads three sums after its kernel
    (``Guard.holds``: are the output, the queries and the keys finite?), instead of copying k
    and v; a plain call finds its bad rows by tensor ops, or by the fused row pass of
    ``nonfinite_rows`` where it is built, and reads nothing; with a gradient wanted nothing
    is read either."""
    force_host_reads(monkeypatch, free=True)
    force_native_rows(monkeypatch, on=False)
    for name, reads in ((kind, 3), ("plain", 0)):
        make = sdpa_path(name, "auto", grad=False)
        count_reads(make(0))
        assert count_reads(make(1)) == ["aten._local_scalar_dense.default"] * reads, name
    make = sdpa_path(kind, "auto", grad=True)
    count_reads(make(0))
    assert count_reads(make(1)) == []
    monkeypatch.undo()  # the fused pass, where it builds, checks a plain call without a read
    force_host_reads(monkeypatch, free=True)
    force_native_rows(monkeypatch, on=True)
    make = sdpa_path("plain", "auto", grad=False)
    count_reads(make(0))
    assert count_reads(make(1)) == []


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="a switch of CPU calls: the suite's are not")
def test_the_cpu_reads_only_when_asked(monkeypatch):
    """``QKV_CPU_HOST_READS``: off by default (DESIGN: no host reads after a structure's first
    use), on with 1, never on another device, and a value it does not know is refused."""
    from qkv.ops import nonfinite

    cpu, meta = torch.device("cpu"), torch.device("meta")
    monkeypatch.delenv("QKV_CPU_HOST_READS", raising=False)
    assert not nonfinite.host_reads_free(cpu)
    make = sdpa_path("bool_mask", "auto", grad=False)
    count_reads(make(0))
    monkeypatch.undo()  # (this file's fixture forced the answer: ask the real switch)
    monkeypatch.delenv("QKV_CPU_HOST_READS", raising=False)
    assert count_reads(make(1)) == []
    monkeypatch.setenv("QKV_CPU_HOST_READS", "1")
    assert nonfinite.host_reads_free(cpu) and not nonfinite.host_reads_free(meta)
    assert count_reads(make(2)) == ["aten._local_scalar_dense.default"] * 3
    monkeypatch.setenv("QKV_CPU_HOST_READS", "yes please")
    with pytest.raises(ValueError, match="QKV_CPU_HOST_READS='yes please': use 1"):
        nonfinite.host_reads_free(cpu)


@pytest.mark.parametrize(
    "kind", ["plain", "causal", "window", "document", "key_lengths", "padded_causal", "prefix_lm"]
)
@pytest.mark.parametrize("trace", [False, True], ids=["tiled", "trace"])
@pytest.mark.parametrize("way", ["kernel", "plan"])
def test_bf16_calls_on_the_native_route_read_nothing_on_the_host(monkeypatch, kind, trace, way):
    """bfloat16 inference through the tiled backend and bfloat16 traces on the native half
    route: on an AMX CPU the fused kernel runs them (ops/bf16_scores.py; elsewhere the other
    ways), from rows' key ranges and document spans made in tensor ops, or the plan where it
    was measured faster (``QKV_BF16_RANGES`` forces each way): the second call of a structure
    reads nothing."""
    monkeypatch.setenv("QKV_CPU_HALF_GEMM", "native")
    monkeypatch.setenv("QKV_BF16_RANGES", way)
    structure = _structure(kind)

    def make(seed: int) -> Callable[[], None]:
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(B, H, L, D, generator=g).bfloat16() for L in (T, S, S))

        def call() -> None:
            with torch.no_grad():
                if trace:
                    qkv.scaled_dot_product_attention(q, k, v, return_trace=True, **structure)
                else:
                    qkv.scaled_dot_product_attention(q, k, v, backend="tiled", **structure)

        return call

    count_reads(make(0))
    assert count_reads(make(1)) == []


@pytest.mark.parametrize("is_causal", [False, True], ids=["plain", "causal"])
@pytest.mark.parametrize("backend", ["auto", "tiled"])
def test_nested_inputs_with_the_offsets_of_the_last_call_read_nothing(is_causal, backend):
    """A model fed nested (jagged) inputs passes the same offsets to every layer: from the
    second call on, the packing (sequence ids, the offsets compared) reads nothing."""
    offsets = torch.tensor([0, 40, 41, 97, 160])

    def make(seed: int) -> Callable[[], None]:
        g = torch.Generator().manual_seed(seed)
        q, k, v = (
            torch.nested.nested_tensor_from_jagged(
                torch.randn(160, H, D, generator=g), offsets=offsets
            ).transpose(1, 2)
            for _ in range(3)
        )  # (B, H, j, D)

        def call() -> None:
            qkv.scaled_dot_product_attention(q, k, v, is_causal=is_causal, backend=backend)

        return call

    count_reads(make(0))
    assert count_reads(make(1)) == []


# --- multi-scale deformable attention ---------------------------------------------------------

_LEVELS = [(4, 5), (2, 3)]  # (H, W) per level: S = 26


def _deformable_kernels() -> list[str]:
    """The kernels of ``qkv.deformable_attention`` this device runs: the torch ops everywhere,
    the C++ loop on the CPU, the Triton kernels on CUDA (on the CPU under triton's interpreter,
    where triton imports)."""
    import importlib.util

    kernels = ["torch", "cpp" if TEST_DEVICE == "cpu" else "triton"]
    if TEST_DEVICE == "cpu" and importlib.util.find_spec("triton") is not None:
        kernels.append("triton")
    return kernels


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("starts", ["given", "derived"])
@pytest.mark.parametrize("shapes_as", ["tensor", "list"])
@pytest.mark.parametrize("kernel", _deformable_kernels())
def test_deformable_calls_read_the_levels_once(kernel, shapes_as, starts, grad):
    """``deformable_attention`` checks that the levels cover the value (a read of
    ``spatial_shapes`` and ``level_start_index``) and copies them to the kernel's device: once
    per tensor. The second call with the same level tensors (or the same list of pairs), on new
    values, locations and weights, reads nothing on the host, forward and backward."""
    import contextlib

    from qkv.ops.deformable import deformable_attention
    from qkv.ops.triton import interpreter

    dev = torch.device(TEST_DEVICE)
    shapes = torch.tensor(_LEVELS, device=dev) if shapes_as == "tensor" else list(_LEVELS)
    level_start = torch.tensor([0, 20], device=dev) if starts == "given" else None
    interpreted = kernel == "triton" and dev.type == "cpu"

    def make(seed: int) -> Callable[[], None]:
        g = torch.Generator().manual_seed(seed)
        value = torch.randn(2, 26, 2, 8, generator=g).to(dev).requires_grad_(grad)
        loc = torch.rand(2, 5, 2, 2, 3, 2, generator=g).to(dev).requires_grad_(grad)
        attn = torch.rand(2, 5, 2, 2, 3, generator=g).softmax(-1).to(dev).requires_grad_(grad)

        def call() -> None:
            with interpreter() if interpreted else contextlib.nullcontext():
                out = deformable_attention(
                    value, shapes, loc, attn, level_start_index=level_start, kernel=kernel
                )
                if grad:
                    out.sum().backward()

        return call

    first = count_reads(make(0))  # (a list of pairs an earlier test gave is remembered)
    assert first != [] or shapes_as == "list"
    assert count_reads(make(1)) == []


@pytest.mark.parametrize("mode", ["grad", "no_grad", "inference_mode"])
@pytest.mark.parametrize("shapes_as", ["tensor", "list"])
def test_the_deformable_module_reads_nothing_on_its_second_call(shapes_as, mode):
    """``MultiScaleDeformableAttention`` with a trace (BEVFormer's layers pass one
    ``spatial_shapes`` to every layer and step): the second call reads nothing on the host,
    its locations' divisor and its trace's level sizes included."""
    import contextlib

    dev = torch.device(TEST_DEVICE)
    torch.manual_seed(0)
    module = qkv.nn.MultiScaleDeformableAttention(
        32, num_heads=4, num_levels=2, num_points=2, batch_first=True
    ).to(dev)
    shapes = torch.tensor(_LEVELS, device=dev) if shapes_as == "tensor" else list(_LEVELS)

    def make(seed: int) -> Callable[[], None]:
        g = torch.Generator().manual_seed(seed)
        query, value = torch.randn(2, 6, 32, generator=g), torch.randn(2, 26, 32, generator=g)
        ref = torch.rand(2, 6, 2, 2, generator=g)
        query, value, ref = query.to(dev), value.to(dev), ref.to(dev)

        def call() -> None:
            context = {
                "grad": contextlib.nullcontext(),
                "no_grad": torch.no_grad(),
                "inference_mode": torch.inference_mode(),
            }[mode]
            with context:
                out, trace = module(
                    query, value=value, reference_points=ref, spatial_shapes=shapes,
                    return_trace=True,
                )  # fmt: skip
            assert trace.locations.shape == (2, 6, 4, 2, 2, 2)
            if mode == "grad":
                out.sum().backward()

        return call

    count_reads(make(0))
    assert count_reads(make(1)) == []


def test_deformable_levels_changed_in_place_are_checked_again():
    """What was read of a level tensor is keyed by its version: written in place so that the
    levels no longer cover the value, the next call raises, as a first call would; a list of
    pairs gives one tensor per value, and a fresh one once that tensor was written."""
    from qkv.ops.deformable import deformable_attention
    from qkv.ops.deformable.inputs import as_spatial_shapes

    g = torch.Generator().manual_seed(0)
    value = torch.randn(1, 26, 2, 8, generator=g)
    loc, attn = torch.rand(1, 5, 2, 2, 3, 2, generator=g), torch.rand(1, 5, 2, 2, 3, generator=g)
    shapes = torch.tensor(_LEVELS)
    first = deformable_attention(value, shapes, loc, attn)
    shapes[1, 1] = 4  # 4x5 + 2x4 = 28 rows, value has 26
    with pytest.raises(ValueError, match=r"sum\(H\*W\) = 28 rows, but value has S = 26"):
        deformable_attention(value, shapes, loc, attn)
    shapes[1, 1] = 3
    assert torch.equal(deformable_attention(value, shapes, loc, attn), first)
    starts = torch.tensor([0, 20])
    deformable_attention(value, shapes, loc, attn, level_start_index=starts)
    starts[1] = 19
    with pytest.raises(ValueError, match=r"level_start_index \[0, 19\] disagrees"):
        deformable_attention(value, shapes, loc, attn, level_start_index=starts)
    pairs = as_spatial_shapes([(4, 5), (2, 3)])
    assert as_spatial_shapes([(4, 5), (2, 3)]) is pairs
    assert torch.equal(pairs, torch.tensor(_LEVELS))
    pairs[0, 0] = 7  # a caller wrote into the remembered tensor (through a trace, say)
    again = as_spatial_shapes([(4, 5), (2, 3)])
    assert again is not pairs and torch.equal(again, torch.tensor(_LEVELS))


def test_deformable_levels_remembered_under_inference_mode_serve_a_gradient_call():
    """The level tensors remembered in a first call under ``torch.inference_mode`` (the
    locations' divisor, the derived starts) are normal tensors: a later call of the same
    module with gradients saves them for backward, and its gradients are finite."""
    torch.manual_seed(0)
    module = qkv.nn.MultiScaleDeformableAttention(
        32, num_heads=4, num_levels=2, num_points=2, batch_first=True
    ).eval()  # (no dropout: the two calls' outputs compared)
    shapes = torch.tensor(_LEVELS)
    query, value, ref = torch.randn(2, 6, 32), torch.randn(2, 26, 32), torch.rand(2, 6, 2, 2)
    with torch.inference_mode():
        expected = module(query, value=value, reference_points=ref, spatial_shapes=shapes)
    out = module(query, value=value, reference_points=ref, spatial_shapes=shapes)
    out.sum().backward()
    assert torch.equal(out.detach(), expected)
    assert all(p.grad is not None and p.grad.isfinite().all() for p in module.parameters())
