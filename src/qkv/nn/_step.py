"""A decoding step of one token of ``MultiHeadAttention`` by a plan kept after its first such
step (issue 38): the in-projection, one call of the few-rows kernel packed once
(``few_rows.Packed``: only the query's and output's pointers and the key count are written per
step) that copies the new key and value rows into the cache and attends, into an output
buffer of the plan's, and the out-projection, with the checks that fix them made as identity
and flag reads.

Why: the module's way of a step (its checks, ``_project``, ``KVCache.append``, the kept lane's
``run`` and the runner's packing, ``_output``) was 1.19-1.21x torch's step by hand at C=512,
one thread, on the AMX Xeon, though each of its parts alone cost little more than torch's.
The step's projections stream megabytes of weights, so every step meets its Python objects
cold in the caches, and the module's way touched many (``benchmarks/RESULTS.md``, seventeenth
session). By the plan: 1.07-1.10x (grouped heads 1.02x), the same ops written flat 1.03x.
Its eight torch ops between the projections (the heads' view, the rows' two narrowed copies,
the output's allocation) still cost 35-50 us of a 250 us step; with the rows copied by the
kernel and the output kept, 0.94-0.95x (bfloat16 0.99-1.00x, grouped 0.81x; twenty-first
session).

What a step checks, each time, so that it is the module's way to the bit or declined (None:
the module's way runs, and makes a plan again where it can):

- the call: a plain CPU tensor ``(B, 1, C)`` of the plan's shape and dtype, no gradient mode,
  no recording, autocast, tracing or forward-mode AD, the dispatcher's state (the few-rows
  switch's among it) as when the plan was made, and the key count in the lane's bucket (a new
  bucket is measured again);
- the module: the same fused in-projection weight and bias (a replaced or parametrized one is
  another), of the plan's dtype on the CPU, the same backend, no dropout in training, no
  context group, a plain ``nn.Linear`` out-projection without hooks;
- the cache: the same ``KVCache`` buffers (a reset of a cache with gradients makes new ones),
  padded (a key mask given since its reset: the kernel reads it in place) as it was, room
  for the token;
- the thread that made the plan (a module stepped from two threads keeps one plan, the
  maker's).
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch import Tensor, nn
from torch.autograd.graph import increment_version

from ..functional import KeptLane, lane_context
from ..ops import few_rows
from ..ops.base import tracing
from ..ops.cpu_isa import linear
from .cache import KVCache

__all__ = ["StepPlan", "has_hooks", "make_plan"]

_MISSING = object()  # (a parameter dict without the entry: a parametrized or removed one)


class StepPlan:
    """What a one-token decoding step of one module over one cache runs (see the module's
    notes); made by :func:`make_plan`, kept in the module's ``KeptLane`` (dropped when the
    lane is kept again, and on copies of the module). The cache's buffers are held weakly: a
    cache the caller drops is freed (a model's whole KV cache, kept alive by its layers' plans
    until the next sequence's first step, would double the memory of the next prefill)."""

    __slots__ = (
        "backend",
        "bias",
        "bias_entry",
        "capacity",
        "cls",
        "dtype",
        "keys",
        "mask",
        "out",
        "packed",
        "shape",
        "state",
        "thread",
        "values",
        "weight",
    )

    def __init__(
        self,
        module: nn.Module,
        query: Tensor,
        cache: KVCache,
        lane,
        packed: few_rows.Packed,
        out: Tensor,
    ) -> None:
        p = module._parameters
        self.cls, self.backend = type(module), module.backend
        weight = p["in_proj_weight"]
        assert weight is not None  # (make_plan)
        self.weight = weakref.ref(weight)  # (weakly too: a replaced weight is freed)
        # the bias the parameters hold, or _MISSING for a module without (its attribute None)
        self.bias_entry = p.get("in_proj_bias", _MISSING)
        self.bias = None if self.bias_entry is _MISSING else self.bias_entry
        self.shape, self.dtype = query.shape, query.dtype
        self.keys, self.values = weakref.ref(cache._k), weakref.ref(cache._v)
        # a padded cache's key mask (the kernel reads it in place), or None for one without
        self.mask = weakref.ref(cache._mask) if cache._padded else None
        self.capacity = min(cache._k.shape[2], cache._v.shape[2])  # (the buffers' own rows)
        self.state = lane.state
        self.packed, self.thread = packed, threading.get_ident()
        # the attention's output (B, 1, H * D), written by each step and read by its
        # out-projection only (whose result is new memory): one buffer for the plan's thread
        self.out = out

    def run(
        self, module: nn.Module, kept: KeptLane, query: Tensor, cache: KVCache
    ) -> Tensor | None:
        """``module(query, cache=cache)`` by the plan, to the bits of the module's way, or None
        where one of its checks fails (nothing is run then, the cache is untouched). ``kept``:
        the module's lane, which holds the plan.

        Shape: query ``(B, 1, C)`` -> ``(B, 1, C)``."""
        lane = kept.lane
        keys, values = cache._k, cache._v
        p = module._parameters
        w = p.get("in_proj_weight")
        if (
            type(query) is not Tensor
            or query.shape != self.shape
            or query.dtype != self.dtype
            or not query.is_cpu
            or type(module) is not self.cls
            or w is None
            or w is not self.weight()
            or p.get("in_proj_bias", _MISSING) is not self.bias_entry
            or w.dtype != self.dtype
            or not w.is_cpu
            or keys is not self.keys()
            or values is not self.values()
            # padded as when planned, and then over the same mask buffer (the kernel's pointer)
            or (cache._mask if cache._padded else None) is not (self.mask and self.mask())
            or lane is None
            or not lane.ok
            or self.thread != threading.get_ident()
        ):
            return None
        S = cache.position + 1
        if (
            self.capacity < S  # (full: the module's way raises)
            or not kept.lo < S <= kept.hi
            or module.backend != self.backend
            or module.context_group is not None
            or (module.training and module.dropout)
            or torch.is_grad_enabled()
            or not lane_context(lane.state)
        ):
            return None
        out_proj = module._modules["out_proj"]
        if type(out_proj) is not nn.Linear or has_hooks(out_proj):
            return None
        qkv = linear(query, w, self.bias)  # (B, 1, (H + 2G) * D): q's heads, k's, v's
        if not qkv.is_contiguous():  # (F.linear's output is: the plan's strides)
            return None
        # the new key and value rows into the cache's row S - 1, then the query's H heads (at
        # qkv's pointer) over its S rows into the plan's buffer (B, 1, H * D), in one call
        self.packed(qkv, self.out, S)
        increment_version((keys, values))  # (written in place, as copy_ would count it)
        cache.position = S
        o = out_proj._parameters
        return linear(self.out, o["weight"], o["bias"])  # (B, 1, C)


def make_plan(
    module: nn.Module, query: Tensor, q: Tensor, cache: KVCache, kept: KeptLane
) -> StepPlan | None:
    """A plan of ``module``'s one-token steps over ``cache``, made right after a step by the
    module's way whose attention call kept a lane of the few-rows kernel (``kept``), or None
    where its steps cannot have one (that step's ``q``, a view of its in-projection, fixes the
    query's layout). Made without gradient, for the thread that asks."""
    lane = kept.lane
    p = module._parameters
    w = p.get("in_proj_weight")
    if (
        lane is None
        or lane.rows is None  # (torch's kernel measured faster: its lane is the module's way)
        or type(cache) is not KVCache
        or torch.is_grad_enabled()
        or tracing()  # (compiled or exported: the graph is the module's way)
        or type(query) is not Tensor
        or not query.is_cpu
        or query.dim() != 3
        or query.shape[1] != 1
        or w is None
        or ("in_proj_bias" not in p and module.__dict__.get("in_proj_bias", _MISSING) is not None)
        or (type(w) is not nn.Parameter and type(w) is not Tensor)
        or type(q) is not Tensor
    ):
        return None
    B, H, T, D = q.shape
    G: int = module.num_kv_heads  # type: ignore[assignment]
    # the step's query: the first H heads of its in-projection, as the module's way made q
    E = (H + 2 * G) * D
    if T != 1 or query.shape[2] != H * D or q.stride() != (E, D, E, 1):
        return None
    S = cache.position
    keys, values = cache._k, cache._v
    keep = cache._mask[:, None, None, :S] if cache._padded else None  # (B, 1, 1, S)
    out = torch.empty((B, 1, H * D), dtype=query.dtype, device="cpu")  # the plan's, each step's
    heads_out = out.view(B, 1, H, D).transpose(1, 2)  # (the kernel's (B, H, 1, D))
    # the step's new key and value rows: its in-projection's heads H.. and H + G.., each call
    # copied by the kernel into the cache's row S - 1 before it reads them (B, G rows of D)
    new_rows = (H * D, (H + G) * D, E, D)
    packed = few_rows.pack(
        q,
        keys.narrow(2, 0, S),
        values.narrow(2, 0, S),
        heads_out,
        lane.causal,
        lane.scale,
        keep,
        new_rows,
    )
    if packed is None or keys.shape[-1] != D or values.shape[-1] != D:
        return None
    return StepPlan(module, query, cache, lane, packed, out)


def has_hooks(m: nn.Module) -> bool:
    """Whether calling ``m`` would run more than its forward: hooks of its own or global ones,
    or a compiled call (``m.compile()``). (Read attribute by attribute: it is asked on every
    call of the module.)"""
    g = _MODULE
    return bool(
        m._forward_hooks
        or m._forward_pre_hooks
        or m._backward_hooks
        or m._backward_pre_hooks
        or g._global_forward_hooks
        or g._global_forward_pre_hooks
        or g._global_backward_hooks
        or g._global_backward_pre_hooks
        or getattr(m, "_compiled_call_impl", None) is not None
    )


_MODULE = torch.nn.modules.module  # (where torch keeps the global hooks)
