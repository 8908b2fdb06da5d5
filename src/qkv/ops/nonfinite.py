"""Inputs holding NaN or inf: they may reach only the rows that may attend to them.

The mask contract says a key a row may not attend to has no effect on that row, whatever its
values, and a row that may attend to nothing outputs 0. Every kernel breaks that by
arithmetic alone: a masked weight is exactly 0, but ``0 * inf = NaN`` in ``probs @ value``,
an additive mask leaves ``NaN + -inf = NaN`` in the scores, and a NaN query spoils its row's
statistics even when the row has no key. So a call whose keys, values or queries hold NaN/inf
runs on zeros in their place, and then exactly the rows that may attend to a bad key, and the
rows of a bad query that have a key to attend to, are set to NaN: what plain math gives those
rows is not finite either.

The contract is kept in two steps around the kernel, which ``scaled_dot_product_attention``
(``functional.py``) takes in order::

    guard = prepare(call)              # the call to run: bad inputs zeroed, or as it is
    result = kernel(guard.call)
    result = guard.restore(result)     # NaN on the rows plain math makes NaN

Both are tensor operations, eagerly as under tracing: nothing is read on the host (on CUDA a
read is a device sync; tests/test_host_reads.py counts them). What they cost on finite inputs:

* **No gradient wanted and every row may attend every key** (no mask, or windows and lengths
  that leave every key to every row, as a decoding step's): nothing before the kernel (with
  no key hidden from a row, no bad key can reach a row it should not); after it, on the CPU
  the output's fused pass computes again, by the plain math, each row that is not finite or
  is all zero, and in bfloat16 and float16 each row whose log-sum-exp from torch's kernel is
  not finite (``dispatch.run_with_lse``), or without one each row of a head whose keys hold
  a NaN/inf (a pass over k); elsewhere one reduction each of q, k and the output sets NaN on the bad
  query rows, the rows a bad key or value reached, and the rows :func:`_key_hits` finds.
  Why the keys matter though no key is hidden: a kernel's row is not always the plain
  math's. torch's CPU flash kernel (every dtype) and tiled's give 0 to a row whose scores
  are all NaN or ``-inf``, as to a row with no key, where the math gives NaN; in bfloat16
  and float16 torch's gives a finite row for a ``+inf`` score (tests/
  test_nonfinite_plain_math.py). A call whose rows are not the plain scaled scores' (a
  score_mod, sinks, dropout, a scale that can overflow) takes the tensor ops' way instead:
  a row its score_mod hides whole is 0 there, and the plain math would give it a value.
* **Otherwise** (masks, gradients, traces): one reduction of each of q, k and v finds their
  bad rows, and one copy of each of k and v (and of q, unless every row may attend its own
  position) has them zeroed: a masked key's NaN would reach its row as ``0 * NaN``, and
  no formulation in tensor ops avoids that copy without knowing the inputs are finite,
  which is a read. After the kernel, the bad keys each row may attend are counted from the
  masks' ranges, documents or matrix (``ops/key_counts.py``), and ``sqrt(-count)`` is the
  column of 0 and NaN added to the output. The copy's gradient is passed through as it is:
  the kernel's gradient is 0 on every bad row already (a NaN row passes no gradient, and a
  masked pair's weight is exactly 0). On the CPU where the fused passes build, a call
  wanting a gradient makes each zeroed copy and its bad rows in one pass
  (``_ZeroNonfiniteRows``) and sets the NaN rows in a copy of the output in one more
  (``_NanRows``): the same bits as the tensor ops' way (tests/test_nonfinite_grad.py).
* **On the CPU without gradient, a bool key mask of a few query rows** (a padded batch's
  decoding step; ``KEYS_IN_PLACE_MAX_T``) **or a range mask** (causal, windows, key lengths):
  no copy and no pass before the kernel; the kernel runs the mask on k and v as they are,
  and the output's fused pass (``nonfinite_rows``, C++) computes again, by the plain math
  over the keys the row may see, the rows it may have got wrong, found as for a call
  without mask: each row that is not finite or is all zero, and in half dtypes each row
  whose log-sum-exp from torch's kernel is not finite, or without one each row of a head
  with a bad key. A hidden key reaches a row only as a NaN (its NaN score stays NaN under
  ``-inf``; its weight 0 times an inf value is NaN), so the other rows are already right,
  and the rows computed again are found inside the pass (nothing read back). Calls with a
  score_mod, sinks, dropout or a scale that can overflow keep the copies.

Where the plain math's row is finite though the row may see a bad key (a key whose scores
are all ``-inf`` weighs 0), the fused passes give that row and the flagging ways (copies,
gradients, traces, tensor ops) give NaN: the cheaper rule, never a finite row where the math
has none (tests/test_mask_contract.py keeps the gradient's case as a strict xfail).

A row's finiteness is one matrix-vector product, ``x @ w`` with ``w`` a power of two below
``1 / (4 D)``: finite for every finite row (no overflow, unlike a sum), not finite for every
row holding NaN or inf, and 20x faster than ``isfinite(x).all(-1)`` on CPU.

A call whose ``scale`` can overflow the scores (beyond the square root of the largest float
the scores are held in, like 1e38 in float32) is also checked for an output that is not
finite from finite inputs, which raises a ValueError naming the overflow: that check reads the
output on the host, for such scales only.

Under tracing, the traced steps below keep the same contract in ops the compilers take.

Shape alphabet: T query length, S key length, Dv value head dim; ``*batch`` as in the call.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor

from .._identity import IdentityCache
from .._measured import env
from ..masks import evaluate_mask, index_grid
from . import nonfinite_rows, nonfinite_triton
from .base import compiling_plainly, tracing
from .call import AttentionCall
from .key_counts import counts, covers_every_key, ranges, sees_own_position

__all__ = ["Guard", "prepare", "run", "scale_may_overflow"]

# What a kernel gives: the output, or ``(output, trace)`` when the call asks for a trace.
Result = Tensor | tuple[Tensor, Any]


@dataclasses.dataclass
class _Bad:
    """Which keys and query rows hold NaN/inf: eagerly ``keys`` ``(B, H, S)`` and ``rows``
    ``(B, H, T)`` float32 (1.0 = bad); traced ``(*kbatch, S)`` (GQA heads expanded) and
    ``(*qbatch, T)`` bool. The old eager form (``_clean``, inside the compiled tiled ops) has
    None where all were finite."""

    keys: Tensor | None
    rows: Tensor | None


@dataclasses.dataclass(slots=True)  # (not frozen: made on every call, a quarter of the cost)
class Guard:
    """The NaN/inf contract of one call, between its steps.

    ``call`` is what the kernel runs: the caller's call, or a copy with the bad rows of q, k
    and v zeroed. ``check`` is what is left to do after the kernel:

    * ``"none"``: nothing (a kernel that keeps the contract itself, or nothing to check);
    * ``"output"``: every row may attend every key and no gradient is wanted: the bad query
      rows become NaN, and the rows the kernel may have got wrong (not finite, all zero;
      half dtypes: an lse that is not finite, or without one a bad key in the head) are
      computed again by the plain math in the fused pass (calls of plain scaled scores:
      :func:`_recomputable`), or become NaN by :func:`_key_hits` in tensor ops;
    * ``"eager"``: ``bad`` holds the bad keys ``(B, H, S)`` and query rows ``(B, H, T)`` (all
      False when finite), and the rows that may attend a bad key become NaN;
    * ``"traced"``: the same in the ops of ``_restore_traced``;
    * ``"in_graph"``: traced inference whose output the ``qkv::checked_output`` op checks.
    * ``"optimistic"``: a masked call run on the inputs as they are, where reads on the host
      are allowed (:func:`host_reads_free`: the CPU, on request): :meth:`holds` says whether
      its result stands.
    * ``"keys"``: a key mask (the same keys hidden from every row of a head) whose hidden keys
      were zeroed in the copies the kernel runs on (``keep``: the keys it lets through): the
      rows that are not finite, the bad query rows and those :func:`_key_hits` finds become
      NaN, and the rows without a key (``has_key`` False) are 0.
    * ``"keys_in_place"``: a bool key mask run on k and v as they are (CPU, no gradient, the
      fused passes built): the rows a hidden NaN/inf reached (no longer finite) are computed
      again from their visible keys (``keep``) in the output's pass, then as ``"keys"``.
    * ``"ranges_in_place"``: masks whose rows see ranges of keys (causal, windows, key
      lengths) run on k and v as they are (CPU, no gradient, the fused passes built; no
      pass before the kernel, no copies): the output's pass sets NaN on bad query rows, 0 on
      rows with an empty range, and computes again from its range ``spans``, by the plain
      math, the rows the kernel may have got wrong, as ``"output"`` finds them (not finite,
      all zero; half dtypes: an lse that is not finite, or without one a bad key in the
      head). A hidden bad key reaches a row only as a NaN, so such a row is not finite.
    """

    call: AttentionCall
    check: Literal[
        "none",
        "output",
        "eager",
        "traced",
        "in_graph",
        "optimistic",
        "keys",
        "keys_in_place",
        "ranges_in_place",
    ]
    bad: _Bad | None = None
    has_key: Tensor | None = None  # "keys": which rows have a key, broadcastable to (*batch, T)
    keep: Tensor | None = None  # "keys", "keys_in_place": the visible keys, bool (*mbatch, S?)
    spans: tuple[Tensor, Tensor] | None = None  # "ranges_in_place": each row's keys [lo, hi)

    def holds(self, result: Result) -> bool:
        """Whether ``result`` is the call's result under the contract as it is: False only for
        an ``"optimistic"`` guard whose output, query or keys hold a NaN/inf, and then the
        call is to run again from ``prepare(call, optimistic=False)``.

        Why three sums decide it: a key or value a row may not attend reaches that row only as
        a NaN (its score is hidden by ``-inf``, ``NaN + -inf = NaN``, and its weight 0 meets
        its value as ``0 * inf = NaN``), or not at all (a hidden ``-inf`` score stays
        ``-inf``); a visible bad value shows as a NaN/inf in its rows. A visible bad key may
        not: a kernel gives 0 to a row whose scores are all NaN or ``-inf``, and torch's
        bfloat16 and float16 CPU kernel a finite row for a ``+inf`` score (see
        :func:`_key_hits`), so the keys are summed too. So a finite output of finite queries
        and keys is what the zeroed inputs give too, to the bit; anything else runs the full
        way, and only then costs twice.
        """
        if self.check != "optimistic":
            return True
        return _all_finite(_output(result), self.call.query, self.call.key)

    def restore(
        self, result: Result, lse: Tensor | None = None, torch_kernel: bool = False
    ) -> Result:
        """The kernel's result under the contract: NaN on every row that may attend to a bad
        key, and on every bad query row that may attend to some key; a ValueError when finite
        inputs gave a non-finite output because the scaled scores overflow (scales that can
        overflow only).

        ``lse``: the log-sum-exp of each row that torch's kernel gave with the output, where
        it did (``dispatch.run_with_lse``): the fused pass then computes again the rows whose
        lse is not finite instead of scanning a half dtype's keys (``nonfinite_rows``).
        ``torch_kernel``: the result is torch's SDPA kernel's (the torch backend's), whose rows
        tell of a bad query row in float32 and float64: the fused pass reads no query row.

        Shape:
            output ``(*batch, T, Dv)``, lse ``(*batch, T)`` -> the same.
        """
        if self.check == "output":
            out, call = _output(result), self.call
            # one fused pass where the CPU takes it (nonfinite_rows: no read); else tensor ops
            # (a sum read would not tell: a kernel's row of NaN scores is 0, see _key_hits)
            inputs = (call.query, call.key, call.value)
            group = _group(call)
            # (rows are computed again by the plain scaled scores: not for a call whose rows are
            # other math, a score_mod's, sinks', dropout's, whose 0 rows may be right)
            if not (
                _recomputable(call)
                and nonfinite_rows.check_rows(
                    out, call.query, inputs, call.scale, group, lse, torch_kernel
                )
            ):
                if lse is not None and out.is_cuda and _recomputable(call):
                    restored = _restore_output_by_lse(out, lse)
                else:
                    restored = _restore_output(call, out)
                result = _with_output(result, restored)
        elif self.check == "keys":
            assert self.has_key is not None and self.keep is not None
            out = _restore_keys(self.call, _output(result), self.has_key, self.keep)
            result = _with_output(result, out)
        elif self.check == "keys_in_place":
            assert self.has_key is not None and self.keep is not None
            result = _with_output(result, _restore_keys_in_place(self, _output(result), lse))
        elif self.check == "ranges_in_place":
            out = _restore_ranges_in_place(self, _output(result), lse)
            result = _with_output(result, out)
        elif self.check == "eager":
            assert self.bad is not None and self.bad.keys is not None
            result = _restore_eager(self.call, self.bad.keys, self.bad.rows, result)
        elif self.check == "traced":
            return _restore_traced(self.call, self.bad, result)
        elif self.check == "in_graph":
            return _checked_in_graph(self.call, result)
        overflows = self.check != "none" and scale_may_overflow(self.call)
        if overflows and not _finite_sum(_output(result)):  # a host read, for such scales only
            _refuse_overflow(self.call)
        return result


def prepare(call: AttentionCall, kept: bool = False, optimistic: bool = True) -> Guard:
    """The first step: the call the kernel is to run, and what is left to check after it.

    ``kept``: the kernel keeps the contract itself (``dispatch.Plan.keeps_nonfinite_contract``).
    ``optimistic``: a call that may be checked after its kernel by a read on the host (see
    :meth:`Guard.holds`) is; False after that check failed, for the call's second run.
    """
    if kept or call.query.is_meta or call.query.numel() == 0 or call.key.numel() == 0:
        return Guard(call, "none")
    if tracing():
        return _prepare_traced(call)
    grad = call.wants_grad
    inference = not grad and not call.return_trace
    if inference:
        call = _without_hidden_keys(call)
        if covers_every_key(call):
            return Guard(call, "output")  # q, k and the output tell, after the kernel
        if optimistic and _checked_after(call):
            return Guard(call, "optimistic")  # the output and q tell, after the kernel, by a read
        keyed = _prepare_key_mask(call)
        if keyed is not None:
            return keyed
    if inference:
        in_place = _prepare_ranges_in_place(call)
        if in_place is not None:
            return in_place
    if (
        inference
        and _native(call.query, call.key, call.value)
        and call.key.shape == call.value.shape
    ):
        # one pass each: the zeroed copies of k and v and their bad rows; q is checked in the
        # output's pass after the kernel (nonfinite_rows.restore_rows), so it needs no copy
        keys = torch.zeros(call.key.shape[:-1], dtype=torch.float32, device=call.key.device)
        k = nonfinite_rows.copy_rows(call.key, zero_nonfinite=True, flags=keys)
        v = nonfinite_rows.copy_rows(call.value, zero_nonfinite=True, flags=keys)
        zeroed = _with_inputs(call, call.query, k, v, (call.key, call.value) + call.sources)
        return Guard(zeroed, "eager", _Bad(_as_bh(keys, call, call.S), None))
    if (
        inference
        and call.key.shape[:-1] == call.value.shape[:-1]
        and nonfinite_triton.takes(call.query, call.key, call.value)
    ):
        by_kernel = _prepare_by_triton(call)
        if by_kernel is not None:
            return by_kernel
    # the gradient's way by the fused passes: one pass per input makes its zeroed copy and its
    # bad rows (the tensor ops' way below took 2.4 ms around a 4.8 ms kernel, B=8, H=8,
    # T=S=128, D=64, float32, one thread); on CUDA by the Triton kernel (3 launches, not 12)
    native = grad and _native_grad(call)
    by_triton = grad and not native and _triton_grad(call)
    if native or by_triton:
        try:
            q, k, v, rows, keys = _ZeroNonfiniteRows.apply(
                call.query, call.key, call.value, by_triton
            )
        except Exception as e:
            if not by_triton:
                raise
            nonfinite_triton.refuse(e)  # triton's compiler or launcher: the tensor ops below
        else:
            bad = _Bad(_as_bh(keys, call, call.S), _as_bh(rows, call, call.T, queries=True))
            sources = (call.query, call.key, call.value) + call.sources
            return Guard(_with_inputs(call, q, k, v, sources), "eager", bad)
    with torch.no_grad():
        rows = _bad_rows(call.query)  # (*qbatch, T): 1.0 on a bad row, else 0.0
        keys = _bad_rows(call.key, call.value)  # (*kbatch, S)
    bad = _Bad(_as_bh(keys, call, call.S), _as_bh(rows, call, call.T, queries=True))
    # a bad query row reaches its own output row only: where every row has a key, that row
    # is set to NaN after the kernel whatever it holds, and q needs no copy
    queries = grad or call.return_trace or not sees_own_position(call)
    return Guard(_zeroed_call(call, grad, queries), "eager", bad)


def _prepare_by_triton(call: AttentionCall) -> Guard | None:
    """The tensor ops' guard below for a call without gradient or trace on CUDA, made by one
    Triton launch per tensor (``nonfinite_triton``) in place of their 11: the same zeroed
    copies of k and v (and of q where a bad query row may reach other rows' output), the same
    bad rows. None where triton failed to build or run the kernel (it says why once, and the
    tensor ops take this call and the next ones)."""
    q, k, v = call.query, call.key, call.value
    rows = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)  # (*qbatch, T)
    keys = torch.empty(k.shape[:-1], dtype=torch.float32, device=k.device)  # (*kbatch, S)
    try:
        q0 = nonfinite_triton.copy_rows(q, rows, copy=not sees_own_position(call))
        k0 = nonfinite_triton.copy_rows(k, keys)
        v0 = nonfinite_triton.copy_rows(v, keys, accumulate=True)
    except Exception as e:  # triton's compiler or launcher, on a machine it does not know
        nonfinite_triton.refuse(e)
        return None
    bad = _Bad(_as_bh(keys, call, call.S), _as_bh(rows, call, call.T, queries=True))
    return Guard(_with_inputs(call, q0, k0, v0, (q, k, v) + call.sources), "eager", bad)


def _triton_grad(call: AttentionCall) -> bool:
    """Whether ``nonfinite_triton``'s kernel takes a gradient call's q, k and v (read without
    their graph, as :func:`_native_grad`'s passes), k and v of one row shape."""
    q, k, v = call.query, call.key, call.value
    return k.shape[:-1] == v.shape[:-1] and nonfinite_triton.takes(
        q.detach(), k.detach(), v.detach()
    )


def _native_grad(call: AttentionCall) -> bool:
    """Whether the fused passes take a gradient call's q, k and v (as they take tensors
    without one: the passes read them, autograd keeps the graph around), with k and v of one
    row shape (their bad rows are one set of flags)."""
    q, k, v = call.query, call.key, call.value
    return k.shape[:-1] == v.shape[:-1] and _native(q.detach(), k.detach(), v.detach())


def _prepare_ranges_in_place(call: AttentionCall) -> Guard | None:
    """The guard of a call without gradient whose rows see ranges of keys (causal, windows,
    key lengths: ``key_counts.ranges``, no documents) on the CPU with the fused passes: the
    kernel runs on k and v as they are (no copies, no pass before it), and the output's pass
    after it finds the rows the kernel may have got wrong from the rows themselves, as for a
    call without mask (see :meth:`Guard.restore`). None for other calls (and those
    :func:`_recomputable` refuses)."""
    if (
        len(call.batch) > 2
        or not _recomputable(call)
        or call.key.shape[:-1] != call.value.shape[:-1]
        or not nonfinite_rows.takes(call.query, call.key, call.value)
        or call.query.dtype != call.key.dtype
        or call.key.dtype != call.value.dtype
    ):
        return None
    spans = ranges(call)  # (lo, hi, doc): None for other masks
    if spans is None or spans[2] is not None:
        return None
    return Guard(call, "ranges_in_place", spans=(spans[0], spans[1]))


def _recomputable(call: AttentionCall) -> bool:
    """Whether the fused passes can compute a row of ``call`` again from its keys: plain
    scaled scores (no ``score_mod``), no sinks and no dropout (a row computed again has
    neither), and a scale that cannot overflow the scores (whose refusal reads the output
    after the copies' way)."""
    return (
        call.score_mod is None
        and call.sinks is None
        and call.dropout_p == 0
        and not scale_may_overflow(call)
    )


def _restore_ranges_in_place(guard: Guard, out: Tensor, lse: Tensor | None = None) -> Tensor:
    """The output of a range mask's call run on k and v as they are (see
    :func:`_prepare_ranges_in_place`), its rows set in the output's pass: 0 where the range
    is empty, NaN for a bad query row, and computed again over its range where the row is not
    finite (a bad key or value it sees, or a hidden one that reached it as a NaN) or all zero,
    and in half dtypes where ``lse`` (torch's kernel's) is not finite, or without one where
    its head's keys hold a NaN/inf.

    Shape:
        out ``(*batch, T, Dv)``, lse ``(*batch, T)`` -> the same.
    """
    call, spans = guard.call, guard.spans
    assert spans is not None
    if not _writable(out, call) or out.stride(-1) != 1:
        out = out.clone(memory_format=torch.contiguous_format)
    if lse is not None and (lse.dtype != torch.float32 or lse.shape != out.shape[:-1]):
        lse = None  # (not the kernel's rows: the keys are scanned instead)
    return nonfinite_rows.restore_rows(
        out,
        query=call.query,
        ranges=(None, spans[0], spans[1]),
        recompute=(call.key, call.value, call.scale, _group(call)),
        lse=lse,
    )


def without_hidden_keys(call: AttentionCall) -> AttentionCall:
    """The call an inference's kernel runs (eager, no gradient, no trace): ``call`` without the
    keys every row is hidden from (:func:`_without_hidden_keys`), else ``call`` itself. The
    plan is chosen for it, so that ``auto``'s measured choice times the call that runs: a
    causal decoding step of one query over 128 bfloat16 keys runs on one key, and timing the
    backends on the 128 sent it to tiled (AMD Zen 4: 0.09 ms) where torch's kernel on the one
    key takes 0.02."""
    if (
        tracing()
        or call.query.is_meta
        or call.query.numel() == 0
        or call.key.numel() == 0
        or call.return_trace
        or call.wants_grad
    ):
        return call  # (as :func:`prepare` leaves them)
    return _without_hidden_keys(call)


def _without_hidden_keys(call: AttentionCall) -> AttentionCall:
    """``call`` without the keys every row is hidden from, where that is told by the sizes:
    top-left causal attention with fewer queries than keys (row ``i`` sees keys ``0..i``, so
    keys ``T..S-1`` reach no row) runs on the first T keys (views). A decoding step of one
    query (T = 1) is then a call whose one row sees its one key: the cheap check of
    ``"output"`` instead of zeroed copies. Not with dropout (its draws are per (T, S)
    element), traces (their (T, S) weights) or other masks; the output is the same."""
    T = call.T
    if (
        not call.is_causal
        or T >= call.S
        or call.attn_mask is not None
        or call.mask_mod is not None
        or call.score_mod is not None
        or call.sinks is not None
        or call.dropout_p > 0
    ):
        return call
    k, v = call.key.narrow(-2, 0, T), call.value.narrow(-2, 0, T)  # (*kbatch, T, D|Dv)
    return _with_inputs(call, call.query, k, v, call.sources)


def _prepare_key_mask(call: AttentionCall) -> Guard | None:
    """The guard of a key mask (an ``attn_mask`` of one row, ``(..., 1, S)``: every row of a
    batch element and head sees the same keys) without gradient: the keys it hides are zeroed
    in copies of k and v, so no hidden NaN/inf can reach a row, and what a visible one does
    shows in the output, as with no mask. None for other calls, and for a mask that varies
    where k and v are shared (a broadcast batch, GQA's heads): each would need its own copy.

    Shape:
        attn_mask ``(*mbatch, 1, S?)``.
    """
    mask = call.attn_mask
    if mask is None or call.is_causal or call.mask_mod is not None or mask.shape[-2] != 1:
        return None
    keep, has_key = _key_mask_rows(mask)  # (*mbatch, S?) bool, (*mbatch, 1) bool
    if mask.dtype == torch.bool and keep.shape[-1] != call.S:
        keep = keep.expand(*keep.shape[:-1], call.S).contiguous()  # (*mbatch, S)
    if (
        mask.dtype == torch.bool
        and call.T <= KEYS_IN_PLACE_MAX_T
        and _recomputable(call)
        and nonfinite_rows.takes_keymask(call.query, call.key, call.value, keep)
    ):
        # the kernel on k and v as they are; its rows that are not finite computed again in
        # the output's pass (nonfinite_rows.keymask_rows), no copies
        return Guard(call, "keys_in_place", has_key=has_key, keep=keep)
    for t in (call.key, call.value):
        if not _broadcasts_onto(keep.shape, t.shape[:-1], gqa=call.enable_gqa):
            return None
    if _native(call.key, call.value) and keep.is_cpu:
        k = nonfinite_rows.copy_rows(call.key, zero_nonfinite=False, keep=keep)
        v = nonfinite_rows.copy_rows(call.value, zero_nonfinite=False, keep=keep)
    else:
        zero = torch.zeros((), dtype=call.dtype, device=call.device)
        k = torch.where(keep.unsqueeze(-1), call.key, zero)  # (*kbatch, S, D)
        v = torch.where(keep.unsqueeze(-1), call.value, zero)  # (*kbatch, S, Dv)
    zeroed = _with_inputs(call, call.query, k, v, (call.key, call.value) + call.sources)
    return Guard(zeroed, "keys", has_key=has_key, keep=keep)


# Key masks of at most this many query rows are run on k and v as they are, and the rows a
# hidden NaN/inf reached computed again (in double, O(S * D) each: a decoding step's few rows);
# longer calls, whose every row a hidden NaN can reach, pay their copies instead (O(S * D) once,
# against their kernel's O(T * S * D)).
KEYS_IN_PLACE_MAX_T = 64

_key_masks = IdentityCache(16)  # a model passes one padding mask to every layer and step


def _key_mask_rows(mask: Tensor) -> tuple[Tensor, Tensor]:
    """Which keys a key mask lets through, and which of its rows have any (remembered by the
    mask's identity and version).

    Shape:
        mask ``(*mbatch, 1, S?)`` -> ``(*mbatch, S?)`` bool and ``(*mbatch, 1)`` bool.
    """

    def rows() -> tuple[Tensor, Tensor]:
        keep = mask[..., 0, :]  # (*mbatch, S?)
        keep = keep if keep.dtype == torch.bool else ~torch.isneginf(keep)  # a NaN is no hidden key
        return keep.contiguous(), keep.any(-1, keepdim=True)  # (*mbatch, S?), (*mbatch, 1)

    return _key_masks.get((mask,), None, rows)


def _broadcasts_onto(shape: tuple, target: tuple, gqa: bool) -> bool:
    """Whether a per-key ``shape`` ``(*mbatch, S?)`` broadcasts onto a tensor's rows
    ``(*kbatch, S)`` without expanding them: each of its dims 1 or the tensor's, its head dim
    1 under GQA (key heads serve several query heads), and no dim beyond the tensor's but 1s."""
    extra = len(shape) - len(target)
    if extra > 0 and any(n != 1 for n in shape[:extra]):
        return False
    for i in range(1, min(len(shape), len(target)) + 1):
        if shape[-i] != 1 and (shape[-i] != target[-i] or (gqa and i == 2)):
            return False
    return True


def _native(*tensors: Tensor | None) -> bool:
    """Whether the fused passes of ``nonfinite_rows`` take these tensors (the CPU, no
    gradient, outside tracing: see that module)."""
    return nonfinite_rows.takes(*tensors)


def run(call: AttentionCall, run_call: Callable[[AttentionCall], Result]) -> Result:
    """``run_call(call)`` under the contract, the steps above in order: for a caller that
    holds its kernel as a function (the ``qkv::checked_output`` op repairs an output so)."""
    guard = prepare(call)
    result = run_call(guard.call)
    if not guard.holds(result):
        guard = prepare(call, optimistic=False)
        result = run_call(guard.call)
    return guard.restore(result)


def host_reads_free(device: torch.device) -> bool:
    """Whether the contract may be kept by reading values on the host: on the CPU, where a
    read waits for no device, and only when ``QKV_CPU_HOST_READS=1`` asks for it.

    Off by default: after a call structure's first use an eager call reads nothing on the host
    (DESIGN.md), which the suite counts on the CPU as the stand-in for CUDA, where each read is
    a sync. On, a masked call without gradient skips the zeroed copies of k and v and the key
    counts, and reads three sums after its kernel instead: 3-5x cheaper at decode sizes on this
    project's CPU before the fused passes ran bool key masks and range masks in place
    (benchmarks/RESULTS.md). Results are the same to the bit either way, but for the rows a
    hidden NaN/inf reaches, which the passes in place compute again in double (the float64
    math's, within the tolerance policy); tests force both (tests/routes.py,
    ``force_host_reads``).
    """
    if device.type != "cpu":
        return False
    raw = env("QKV_CPU_HOST_READS") or ""
    known = _READS_SWITCH.get(raw)
    if known is None:
        value = raw.strip().lower()
        if value not in ("", "0", "off", "1", "on"):
            raise ValueError(f"QKV_CPU_HOST_READS={raw!r}: use 1 (on) or 0 (off, the default)")
        known = _READS_SWITCH[raw] = value in ("1", "on")
    return known


_READS_SWITCH: dict[str, bool] = {}  # QKV_CPU_HOST_READS's raw value -> on/off (read per call)


def _all_finite(*tensors: Tensor) -> bool:
    """Whether ``tensors`` hold no NaN/inf, by reading their sums (a finite sum that
    overflows, beyond float32's range, only sends the call the full way)."""
    total = 0.0
    for t in tensors:
        x = t.detach()  # (no graph for a check)
        half = x.dtype in (torch.float16, torch.bfloat16)  # a half sum overflows early
        total += (x.sum(dtype=torch.float32) if half else x.sum()).item()
    return math.isfinite(total)


def _checked_after(call: AttentionCall) -> bool:
    """Whether ``call`` may run optimistically (``Guard.holds``): reads are free on its
    device, and running it twice changes nothing (dropout would draw twice)."""
    return call.dropout_p == 0.0 and host_reads_free(call.device)


# --- eager ----------------------------------------------------------------------------------


def _restore_eager(
    call: AttentionCall, keys: Tensor, rows: Tensor | None, result: Result
) -> Result:
    """NaN on the rows that may attend a bad key, and on the bad query rows that may attend
    some key, counted by :func:`qkv.ops.key_counts.counts`. ``rows`` None: the query rows are
    checked here, in the output's pass (``nonfinite_rows.restore_rows``), which also sets the
    rows without a key to 0 (what a kernel gave for a bad query there does not count).

    Shape:
        keys ``(B, H, S)``, rows ``(B, H, T)`` of 0.0 and 1.0 (1 = bad); output
        ``(*batch, T, Dv)`` -> the same.
    """
    out = _output(result)
    if rows is None and _native(out, call.query) and len(call.batch) <= 2:
        if not _writable(out, call):
            out = out.clone()
        spans = ranges(call)  # (lo, hi, doc): causal, windows, key lengths; None for others
        if spans is not None and spans[2] is None:  # counted in the output's pass
            out = nonfinite_rows.restore_rows(
                out, query=call.query, ranges=(keys.contiguous(), spans[0], spans[1])
            )
            return _with_output(result, out)
    if rows is not None and len(call.batch) == 2 and nonfinite_triton.takes_output(out):
        spans = ranges(call)  # causal, windows, key lengths (no documents): one launch
        if spans is not None and spans[2] is None:
            done = _nan_rows_by_triton(call, out, keys, rows, spans[0], spans[1])
            if done is not None:
                return _with_output(result, done)
    hits, n_keys = counts(call, keys)  # (B, H, T): bad keys each row may attend; its keys
    own = sees_own_position(call)  # (then every row has a key)
    if rows is None and _native(out, call.query) and len(call.batch) <= 2:
        has_key = None if own else _as_batch((n_keys > 0).expand(hits.shape), call)
        out = nonfinite_rows.restore_rows(
            out, query=call.query, flags=_as_batch(hits, call), has_key=has_key
        )
        return _with_output(result, out)
    if rows is None:  # (the query was not zeroed: a row without a key is set to 0 here)
        rows = _as_bh(_bad_rows(call.query), call, call.T, queries=True)  # (B, H, T)
        if not own:
            has_key = (n_keys > 0).expand(hits.shape).reshape(call.batch + (call.T, 1))
            out = torch.where(has_key, out, torch.zeros((), dtype=out.dtype, device=out.device))
    hits = hits + (rows if own else rows * (n_keys > 0))  # (B, H, T)
    if out.requires_grad and _native(out.detach()):  # one pass: NaN rows set in a copy
        return _with_output(result, _NanRows.apply(out, _as_batch(hits, call)))
    nan = hits.neg_().sqrt_()  # (B, H, T): sqrt(-0) = -0, sqrt(-n) = NaN for n > 0
    nan = nan.to(call.dtype).reshape(call.batch + (call.T, 1))  # (*batch, T, 1)
    if out.requires_grad:
        out = out * (nan == nan).to(out.dtype)  # no gradient through a NaN row
    elif not _own(out):
        return _with_output(result, out + nan)
    return _with_output(result, out.add_(nan))


def _nan_rows_by_triton(
    call: AttentionCall, out: Tensor, keys: Tensor, rows: Tensor, lo: Tensor, hi: Tensor
) -> Tensor | None:
    """:func:`_restore_eager`'s rows set by the Triton kernel (``nonfinite_triton.nan_rows``)
    for rows that see ranges of keys, into ``out`` or a copy of it; None where triton failed
    (it says why once; the tensor ops go on)."""
    if not _own(out):
        out = out.clone()
    try:
        return nonfinite_triton.nan_rows(out, keys, lo, hi, rows, sees_own_position(call))
    except Exception as e:  # triton's compiler or launcher, on a machine it does not know
        nonfinite_triton.refuse(e)
        return None


def _as_batch(flags: Tensor, call: AttentionCall) -> Tensor:
    """Per-row flags ``(B, H, T)`` in the call's batch layout (a view).

    Shape:
        ``(B, H, T)`` -> ``(*batch, T)``.
    """
    return flags if len(call.batch) == 2 else flags.reshape(call.batch + (call.T,))


def _writable(out: Tensor, call: AttentionCall) -> bool:
    """Whether ``out`` may be written in place row by row: a kernel's output of its own memory
    (its own buffer, or a permuted view of one, as torch's CPU flash kernel returns) that
    autograd does not need, with no broadcast dim, and none of the call's inputs."""
    if out.requires_grad:
        return False
    for n, st in zip(out.shape, out.stride()):
        if st == 0 and n > 1:
            return False  # a broadcast dim: one write would land in several rows
    base = out._base
    if base is None:
        base = out
    elif base.numel() != out.numel():
        return False  # a slice of something larger
    return not any(base is t or base is t._base for t in (call.query, call.key, call.value))


def _restore_keys(call: AttentionCall, out: Tensor, has_key: Tensor, keep: Tensor) -> Tensor:
    """The output of a key mask's call (its hidden keys zeroed): NaN on each row that is not
    finite (a visible bad key or value reached it), on each bad query row and on the rows
    :func:`_key_hits` finds, then 0 on the rows without a key (whatever a kernel gave there
    for a bad query).

    Shape:
        out ``(*batch, T, Dv)``, has_key broadcastable to ``(*batch, T)``, keep ``(*mbatch,
        S?)`` -> the same.
    """
    hits = _key_hits(call, keep)  # (*lead, 1) float32: 1.0 where the rows are NaN
    if _native(out, call.query):
        if not _writable(out, call):
            out = out.clone()
        return nonfinite_rows.restore_rows(
            out, query=call.query, check_out=True, flags=hits, has_key=has_key
        )
    rows = out @ _column(out)  # (*batch, T, 1): finite exactly where the row is
    query_rows = call.query @ _column(call.query)  # (*qbatch, T, 1)
    rows = rows + torch.where(has_key.unsqueeze(-1), query_rows, 0.0)  # (*batch, T, 1)
    rows = rows + hits.neg().sqrt_().unsqueeze(-1).to(rows.dtype)  # NaN where hit
    return torch.where(has_key.unsqueeze(-1), out.add(rows, alpha=0), 0.0)


def _key_hits(call: AttentionCall, keep: Tensor | None) -> Tensor:
    """Where a kernel's output cannot tell a row the plain math makes NaN, by the keys the
    row sees (``keep``: those a key mask lets through; None: all), in tensor ops (no read).

    * Every key a row sees holds a NaN/inf in k: then each of its scores is ``+-inf`` or NaN
      (a finite query times an infinite entry), and the plain math gives NaN. A kernel may
      give the row 0 instead, as for a row with no key: torch's CPU flash kernel and tiled's
      do when the scores are all NaN or ``-inf``. Exact: a row that sees one finite key has a
      finite score, and the kernel's row stands.
    * In bfloat16 and float16, any key a row sees holds one: torch's CPU flash kernel gives
      a finite row, neither NaN nor the plain math's, for a key whose score is ``+inf``. The
      row is NaN, where the plain math is NaN too except for keys whose scores are all
      ``-inf`` (weight 0): the fused pass computes those rows again instead
      (``nonfinite_rows``).

    One matrix-vector product over k, and sums over keys.

    Shape:
        keep ``(*mbatch, S?)`` bool -> ``(*lead, 1)`` float32 of 0.0 and 1.0, ``lead`` the
        heads' batch (key heads repeated for their query heads), broadcastable to the
        output's ``(*batch, T)``.
    """
    bad = _bad_rows(call.key)  # (*kbatch, S): 1.0 on a key holding a NaN/inf
    if call.enable_gqa:
        bad = bad.repeat_interleave(_group(call), dim=-2)  # (*batch', S)
    S = call.S
    n: Tensor | float
    if keep is None:
        seen, n = bad.sum(-1), float(S)  # (*kbatch)
    else:
        kept = keep.to(torch.float32)  # (*mbatch, S?)
        seen = (bad * kept).sum(-1)  # (*lead): bad keys the row sees
        n = kept.sum(-1) * (S if kept.shape[-1] == 1 else 1)  # (*mbatch): keys it sees
    half = call.dtype in (torch.float16, torch.bfloat16)
    hit = (seen > 0) if half else (seen == n) & (seen > 0)
    return hit.to(torch.float32).unsqueeze(-1)  # (*lead, 1)


def _restore_keys_in_place(guard: Guard, out: Tensor, lse: Tensor | None = None) -> Tensor:
    """The output of a bool key mask's call run on k and v as they are: rows without a key 0,
    rows that are not finite (a hidden or visible bad key reached them), all zero, or have a
    bad query row computed again from their visible keys (``nonfinite_rows.keymask_rows``);
    in half dtypes also the rows whose ``lse`` (torch's kernel's) is not finite, or without
    one the rows of a head whose keys hold a NaN/inf.

    Shape:
        out ``(*batch, T, Dv)``, lse ``(*batch, T)`` -> the same.
    """
    call, keep = guard.call, guard.keep
    assert keep is not None and guard.has_key is not None
    if not _writable(out, call) or out.stride(-1) != 1:
        out = out.clone(memory_format=torch.contiguous_format)
    nonfinite_rows.keymask_rows(
        out, call.query, call.key, call.value, keep, scale=call.scale, group=_group(call), lse=lse
    )
    return out


def _own(out: Tensor) -> bool:
    """Whether ``out`` may be written in place: a kernel's output of its own memory (not an
    expanded view) that autograd does not need."""
    return not out.requires_grad and (out._base is None or out.is_contiguous())


def _restore_output(call: AttentionCall, out: Tensor) -> Tensor:
    """``out`` of a call whose every row may attend every key, with NaN on each row that is
    not finite (a bad key or value shows there: NaN scores, or its weight times NaN/inf), on
    each bad query row (torch's CPU kernels give some of those 0) and on the rows
    :func:`_key_hits` finds (a kernel's 0 for scores all NaN or ``-inf``; bfloat16's and
    float16's finite rows for a ``+inf`` score). The tensor ops' way; the fused pass
    (``nonfinite_rows.check_rows``) computes the rows again instead, by the plain math.

    Shape:
        out ``(*batch, T, Dv)`` -> the same.
    """
    q = call.query  # (no gradient is wanted here: the ops record no graph)
    rows = out @ _column(out)  # (*batch, T, 1): finite exactly where the row is
    rows.add_(q @ _column(q))  # + the query rows' (each below a quarter of the largest float)
    rows = rows + _key_hits(call, None).neg_().sqrt_().unsqueeze(-1).to(rows.dtype)
    if _own(out):
        return out.add_(rows, alpha=0)  # + 0 * rows: 0, or NaN where anything was bad
    return out.add(rows, alpha=0)


def _restore_output_by_lse(out: Tensor, lse: Tensor) -> Tensor:
    """``out`` of a call whose every row may attend every key, by torch's CUDA kernel (cuDNN's
    or flash's) with its log-sum-exp ``lse``: NaN on each row whose output or lse is not
    finite, and the kernel's row elsewhere. Three ops, none over q or k (the tensor ops' way,
    :func:`_restore_output`, scans both and counts bad keys: 14 ops).

    It leans on the kernel's lse of a row whose scores are all ``-inf``: flash's is ``+inf``
    (``sum == 0``), cuDNN's NaN or an infinity (``-inf - -inf``). torch's CPU flash kernel
    gives such a row 0 and an lse of 0, so the CPU keeps its fused pass (``nonfinite_rows``,
    which computes all-zero rows again) or the tensor ops. tests/test_cuda.py holds the rule
    to the plain math on the GPU.

    Exact against the plain math, for plain softmax rows: a row's scores are not finite in
    the kernel exactly where they are not in the math (a NaN or infinite entry of q or k
    gives NaN or an infinity whatever the precision; finite inputs whose scores overflow are
    the overflow refusal's, ``scale_may_overflow``); the math's row is NaN where a score is
    NaN or ``+inf``, or all of them are ``-inf`` (0 / 0), which is where the lse is not
    finite (NaN, or an infinity); a ``-inf`` score among finite ones weighs 0 in both. With
    finite scores, a NaN/inf value reaches the output as in the math (``0 * inf`` is NaN in
    a kernel's product too).

    Shape:
        out ``(*batch, T, Dv)``, lse ``(*batch, T)`` -> the same.
    """
    rows = out @ _column(out)  # (*batch, T, 1): finite exactly where the row is
    rows.add_(lse.reshape(rows.shape), alpha=0)  # + 0 * lse: NaN where the lse is not finite
    if _own(out):
        return out.add_(rows, alpha=0)  # + 0 * rows: 0, or NaN where anything was bad
    return out.add(rows, alpha=0)


def _group(call: AttentionCall) -> int:
    """Query heads per key head: ``H // G`` under GQA, else 1."""
    return call.query.shape[-3] // call.key.shape[-3] if call.enable_gqa else 1


def _column(t: Tensor) -> Tensor:
    """``(E, 1)`` weights for ``t @ column`` (E = ``t``'s last dim): a finite row's weighted
    sum stays below a quarter of the largest float (see :func:`_row_weights`)."""
    key = ("column", t.shape[-1], t.dtype, t.device)
    w = _WEIGHTS.get(key)
    if w is None:
        w = _WEIGHTS[key] = _row_weights(t).unsqueeze(-1)
    return w


def _bad_rows(*tensors: Tensor) -> Tensor:
    """Which rows hold a NaN or inf in any of ``tensors`` (of one row shape), by one matrix-
    vector product each (see the module's notes), accumulated by ``addmv`` where the rows
    line up (one op, not two: a short call's cost is the ops it dispatches).

    Shape:
        ``(*lead, L, E)`` each -> ``(*lead, L)`` float32, 1.0 on a bad row and 0.0 on others
        (the broadcast of their leads).
    """
    total = None
    for t in tensors:
        w = _row_weights(t)  # (E,)
        flat = t.dim() > 2 and t.numel() and t.is_contiguous()
        if flat and total is not None and total.shape == t.shape[:-1]:
            total = torch.addmv(total.view(-1), t.view(-1, t.shape[-1]), w).view(total.shape)
        elif flat:
            total = torch.mv(t.view(-1, t.shape[-1]), w).view(t.shape[:-1])  # (*lead, L)
        else:
            row = t @ w  # (*lead, L): below a quarter of the largest float when finite
            total = row if total is None else total + row
    assert total is not None
    # 0 * finite = 0; 0 * inf and 0 * NaN are NaN, which becomes 1
    return torch.nan_to_num(total.float().mul_(0), nan=1.0)


_WEIGHTS: dict[tuple, Tensor] = {}


def _row_weights(t: Tensor) -> Tensor:
    """``(E,)`` of ``2^-k`` with ``2^k > 4 E`` (E = ``t``'s last dim), in ``t``'s dtype and
    device: a finite row's weighted sum stays below a quarter of the largest float, so up to
    three such sums add up without overflow. Made once per (E, dtype, device)."""
    E = t.shape[-1]
    key = (E, t.dtype, t.device)
    w = _WEIGHTS.get(key)
    if w is None:
        w = torch.full((E,), 2.0 ** -(4 * max(E, 1)).bit_length(), dtype=t.dtype, device=t.device)
        _WEIGHTS[key] = w
    return w


def _as_bh(flags: Tensor, call: AttentionCall, L: int, queries: bool = False) -> Tensor:
    """Bad keys ``(*kbatch, S)`` (or, with ``queries``, bad query rows ``(*qbatch, T)``) as
    ``(B, H, L)``, GQA's key heads repeated for their query heads; no op where they are
    so already.

    Shape:
        ``(*lead, L)`` -> ``(B, H, L)``.
    """
    if call.enable_gqa and not queries:
        flags = flags.repeat_interleave(call.query.shape[-3] // call.key.shape[-3], dim=-2)
    B, H = call.BH
    if flags.shape == (B, H, L):
        return flags
    return flags.expand(call.batch + (L,)).reshape(B, H, L)


def _zeroed_call(call: AttentionCall, grad: bool, queries: bool = True) -> AttentionCall:
    """The call with every NaN/inf of k and v (and of q, with ``queries``) replaced by 0 (one
    copy each)."""
    q, k, v = call.query, call.key, call.value
    if grad:
        q, k, v = _ZeroNonfinite.apply(q, k, v)
    else:
        q = q.nan_to_num(0.0, 0.0, 0.0) if queries else q
        k, v = k.nan_to_num(0.0, 0.0, 0.0), v.nan_to_num(0.0, 0.0, 0.0)
    sources = (call.query, call.key, call.value) + call.sources  # a trace checks them too
    return _with_inputs(call, q, k, v, sources)


def _with_inputs(call: AttentionCall, q: Tensor, k: Tensor, v: Tensor, sources) -> AttentionCall:
    """``dataclasses.replace(call, query=q, ...)`` in a fifth of its time (which runs
    ``__init__`` anew; these inputs are the call's own, zeroed)."""
    new = object.__new__(AttentionCall)
    new.__dict__.update(  # (frozen); another call's inputs: no structure of its own
        call.__dict__, query=q, key=k, value=v, sources=sources, structure=None
    )
    return new


class _ZeroNonfinite(torch.autograd.Function):
    """``nan_to_num(t, 0, 0, 0)`` of q, k and v, whose gradient is passed through as it is:
    the kernel's gradient at a bad row is exactly 0 already (the rows that may attend it are
    set to NaN and pass none; rows that may not give it weight exactly 0), and
    ``nan_to_num``'s own backward (``grad * isfinite(t)``) costs a pass of a slow op per
    tensor."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor):
        return tuple(t.nan_to_num(0.0, 0.0, 0.0) for t in (q, k, v))

    @staticmethod
    def backward(ctx, dq: Tensor, dk: Tensor, dv: Tensor):
        return dq, dk, dv

    @staticmethod
    def jvp(ctx, dq: Tensor, dk: Tensor, dv: Tensor):  # forward-mode AD: passed through alike
        return dq, dk, dv


class _ZeroNonfiniteRows(torch.autograd.Function):
    """:class:`_ZeroNonfinite` by the fused passes (``nonfinite_rows.copy_rows``, or with
    ``by_triton`` CUDA's kernel, ``nonfinite_triton.copy_rows``): the zeroed copies of q, k
    and v and which of their rows held a NaN/inf, one pass per input; the gradient passed
    through as there.

    Shape:
        q ``(*qbatch, T, D)``, k ``(*kbatch, S, D)``, v ``(*kbatch, S, Dv)`` -> the zeroed
        copies (contiguous), rows ``(*qbatch, T)`` and keys ``(*kbatch, S)`` float32, 1.0 on
        a row that held a NaN/inf (of k or v for keys).
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, by_triton: bool):
        rows = torch.zeros(q.shape[:-1], dtype=torch.float32, device=q.device)
        keys = torch.zeros(k.shape[:-1], dtype=torch.float32, device=k.device)
        if by_triton:
            q0 = nonfinite_triton.copy_rows(q, rows)
            k0 = nonfinite_triton.copy_rows(k, keys, accumulate=True)
            v0 = nonfinite_triton.copy_rows(v, keys, accumulate=True)
        else:
            q0 = nonfinite_rows.copy_rows(q, zero_nonfinite=True, flags=rows)
            k0 = nonfinite_rows.copy_rows(k, zero_nonfinite=True, flags=keys)
            v0 = nonfinite_rows.copy_rows(v, zero_nonfinite=True, flags=keys)
        ctx.mark_non_differentiable(rows, keys)
        return q0, k0, v0, rows, keys

    @staticmethod
    def backward(ctx, dq: Tensor, dk: Tensor, dv: Tensor, _rows, _keys):
        return dq, dk, dv, None

    @staticmethod
    def jvp(ctx, dq: Tensor, dk: Tensor, dv: Tensor, _by_triton):  # forward-mode AD: passed
        return dq, dk, dv, None, None  # through alike


class _NanRows(torch.autograd.Function):
    """``out`` with NaN on the rows where ``hits`` is not 0, in a copy of ``out``'s layout (a
    kernel's permuted output stays so: a module's merge of the heads is then a view) whose
    rows are set by a fused pass (``nonfinite_rows``), and no gradient through those rows (the
    tensor ops' way was a product and a sum, each a pass of a strided TensorIterator).

    Shape:
        out ``(*batch, T, Dv)``, hits ``(*batch, T)`` float32 -> ``(*batch, T, Dv)``.
    """

    @staticmethod
    def forward(ctx, out: Tensor, hits: Tensor):
        bad = hits != 0  # (*batch, T)
        copy = out.clone()  # (its layout kept; a plain copy of its memory)
        nonfinite_rows.restore_rows(copy, flags=hits)
        ctx.save_for_backward(bad)
        return copy

    @staticmethod
    def backward(ctx, grad: Tensor):
        (bad,) = ctx.saved_tensors
        copy = grad.clone()  # (a gradient of stride 0 comes out dense)
        if nonfinite_rows.takes(copy):  # 0 on the NaN rows
            return nonfinite_rows.restore_rows(copy, has_key=~bad), None
        return copy.masked_fill_(bad.unsqueeze(-1), 0.0), None


def scale_may_overflow(call: AttentionCall) -> bool:
    """Whether ``scale`` is past the square root of the largest float the scores are held in
    (float32 for half inputs): only then can inputs far from that float overflow the scores."""
    bound = _SCALE_BOUND.get(call.dtype)
    if bound is None:
        largest = torch.finfo(torch.promote_types(call.dtype, torch.float32)).max
        bound = _SCALE_BOUND[call.dtype] = math.sqrt(largest)
    return abs(call.scale) > bound


_SCALE_BOUND: dict[torch.dtype, float] = {}


def _refuse_overflow(call: AttentionCall) -> None:
    """ValueError when the scaled scores can overflow: ``|scale| * max|q_i| * max|k_j|`` beyond
    the largest float the scores are computed in (float32 for half inputs). Softmax of such
    scores is ``inf - inf = NaN`` on every backend; the caller asked for a temperature the
    dtype cannot hold. Called only when finite inputs gave a non-finite output."""
    with torch.no_grad():
        q_norm = call.query.detach().double().norm(dim=-1).max()
        k_norm = call.key.detach().double().norm(dim=-1).max()
        bound = abs(call.scale) * float(q_norm) * float(k_norm)
    largest = torch.finfo(torch.promote_types(call.dtype, torch.float32)).max
    if bound > largest:
        raise ValueError(
            f"the scaled scores overflow: scale={call.scale:g} times |q||k| up to "
            f"{float(q_norm) * float(k_norm):.3g} reaches {bound:.3g}, beyond the largest "
            f"{torch.promote_types(call.dtype, torch.float32)} ({largest:.3g}), so softmax "
            f"would be NaN; pass a smaller scale (a sharper softmax than this is the hard max: "
            f"take the argmax of the scores)"
        )


def _finite_sum(t: Tensor) -> bool:
    """Whether ``t`` holds no NaN/inf, by one reduction: a sum is finite when every term is
    (one that overflows only sends the call the slow, still exact, way)."""
    return math.isfinite(t.detach().sum().item())


def _clean(call: AttentionCall) -> tuple[AttentionCall, _Bad | None]:
    """The call with non-finite keys, values and query rows zeroed, and which they were."""
    q, k, v = call.query, call.key, call.value
    if _finite_sum(q) and _finite_sum(k) and _finite_sum(v):
        return call, None
    with torch.no_grad():
        bad_q = ~torch.isfinite(q).all(-1)  # (*qbatch, T)
        bad_k = ~torch.isfinite(k).all(-1)  # (*kbatch, S)
        bad_v = ~torch.isfinite(v).all(-1)  # (*kbatch, S)
    if not (bad_q.any() or bad_k.any() or bad_v.any()):
        return call, None
    q, k, v = (
        torch.where(bad.unsqueeze(-1), 0.0, t).to(t.dtype)
        for bad, t in ((bad_q, q), (bad_k, k), (bad_v, v))
    )
    keys = torch.broadcast_tensors(bad_k, bad_v)
    keys = keys[0] | keys[1]  # (*kbatch, S)
    if call.enable_gqa:
        keys = keys.repeat_interleave(call.query.shape[-3] // call.key.shape[-3], dim=-2)
    bad = _Bad(keys if keys.any() else None, bad_q if bad_q.any() else None)
    return dataclasses.replace(call, query=q, key=k, value=v), bad


def _poison(out: Tensor, call: AttentionCall, bad: _Bad) -> Tensor:
    """``out`` with NaN on every row that may attend to a bad key, and on every bad query row
    that may attend to some key.

    Shape:
        out ``(*batch, T, Dv)`` -> the same.
    """
    hit = torch.zeros(call.batch + (call.T,), dtype=torch.bool, device=out.device)  # (*batch, T)
    if bad.keys is not None:
        cols = bad.keys.reshape(-1, call.S).any(0).nonzero().squeeze(-1)  # (nc,) bad somewhere
        hit = hit | (allowed(call, cols=cols) & bad.keys[..., None, cols]).any(-1)
    if bad.rows is not None:
        rows = bad.rows.reshape(-1, call.T).any(0).nonzero().squeeze(-1)  # (nr,) bad somewhere
        alive = allowed(call, rows=rows).any(-1)  # (*batch, nr)
        hit[..., rows] |= alive & bad.rows[..., rows]
    return out.masked_fill(hit.unsqueeze(-1), float("nan"))


# --- traced ---------------------------------------------------------------------------------


def _prepare_traced(call: AttentionCall) -> Guard:
    """The contract in tensor ops only, for a traced call. With no gradient wanted, the
    output alone is checked, as eagerly, by the ``qkv::checked_output`` op where the masks
    can be carried to it. Otherwise every call runs on the cleaned inputs (one copy of q, k
    and v) and :func:`_restore_traced` finds the rows to poison.

    (``torch.cond`` would skip the cleaning on finite inputs, but dynamo then lost the
    attribute writes of Hugging Face's KV cache in the same graph: not used.)
    """
    if not call.wants_grad and _output_checkable_in_graph(call):
        return Guard(call, "in_graph")
    q, k, v = call.query, call.key, call.value
    bad_q = ~torch.isfinite(q).all(-1)  # (*qbatch, T)
    bad_k = ~torch.isfinite(k).all(-1)  # (*kbatch, S)
    bad_v = ~torch.isfinite(v).all(-1)  # (*kbatch, S)
    cleaned = dataclasses.replace(
        call, query=_zeroed(q, bad_q), key=_zeroed(k, bad_k), value=_zeroed(v, bad_v)
    )
    keys = bad_k | bad_v  # (*kbatch, S)
    if call.enable_gqa:
        keys = keys.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-2)
    return Guard(cleaned, "traced", _Bad(keys, bad_q))


def _zeroed(t: Tensor, bad: Tensor) -> Tensor:
    """``t`` with its ``bad`` rows 0, one traceable op."""
    return torch.where(bad.unsqueeze(-1), torch.zeros((), dtype=t.dtype, device=t.device), t)


def _restore_traced(call: AttentionCall, bad: _Bad | None, result: Result) -> Result:
    """NaN on the rows to poison. They come from a custom op that returns at once when every
    input is finite (``tiled_op.nonfinite_rows``) where the masks can be carried to it;
    otherwise from a search of the whole ``(T, S)`` grid of allowed pairs, which the compiler
    fuses into one reduction instead of materialising it."""
    from .tiled import op as tiled_op

    assert bad is not None and bad.keys is not None and bad.rows is not None  # _prepare_traced
    hit = tiled_op.nonfinite_rows(call, bad.rows, bad.keys)  # (*batch, T), or None
    if hit is None:
        ok = allowed(call)  # (*batch, T, S)
        hit = (ok & bad.keys.unsqueeze(-2)).any(-1) | (bad.rows & ok.any(-1))  # (*batch, T)
    out = _output(result).masked_fill(hit.unsqueeze(-1), float("nan"))
    return _with_output(result, out)


def _output_checkable_in_graph(call: AttentionCall) -> bool:
    """Whether ``tiled_op.checked_inference`` takes ``call``: its own conditions (compiling
    plainly; no dropout, trace or sinks; masks and score_mod it can describe), asked before
    the kernel runs, since the inputs are cleaned before it where the op cannot be used."""
    from .tiled import op as tiled_op

    if not compiling_plainly() or call.dropout_p > 0 or call.return_trace or call.sinks is not None:
        return False
    parts, score = tiled_op._Parts(), call.score_mod
    score = None if score is None else score.bind(*call.BH, call.T, call.S)
    mask_spec = tiled_op._describe(tiled_op._bound_mask(call), parts)
    return mask_spec is not None and tiled_op._describe(score, parts) is not None


def _checked_in_graph(call: AttentionCall, result: Result) -> Result:
    """The output of an inference call, summed in the ``qkv::checked_output`` op and redone
    there under the eager contract only when it is not finite."""
    from .tiled import op as tiled_op

    # checked_inference takes the kernel as a function; the kernel has already run here
    checked = tiled_op.checked_inference(call, lambda _: result)
    assert checked is not None  # _output_checkable_in_graph(call) said it would take it
    return checked


# --- both -----------------------------------------------------------------------------------


def _output(result: Result) -> Tensor:
    return result[0] if isinstance(result, tuple) else result


def _with_output(result: Result, out: Tensor) -> Result:
    return (out, result[1]) if isinstance(result, tuple) else out


def allowed(
    call: AttentionCall, *, rows: Tensor | None = None, cols: Tensor | None = None
) -> Tensor:
    """Whether query ``rows`` may attend to keys ``cols`` (None: all), under every mask of the
    call (attn_mask, is_causal, mask_mod; a float mask's ``-inf`` hides a key).

    Shape:
        rows ``(nr,)``, cols ``(nc,)`` int64 -> ``(*batch, nr, nc)`` bool.
    """
    B, H = call.BH
    dev = call.device
    rows = torch.arange(call.T, device=dev) if rows is None else rows
    cols = torch.arange(call.S, device=dev) if cols is None else cols
    nr, nc = rows.numel(), cols.numel()
    out = torch.ones(1, 1, nr, nc, dtype=torch.bool, device=dev)  # (1, 1, nr, nc)
    q, kv = rows.view(1, 1, nr, 1), cols.view(1, 1, 1, nc)
    if call.attn_mask is not None:
        mask = call.mask_4d(call.attn_mask)  # (B?, H?, T?, S?)
        mask = mask[..., rows, :] if mask.shape[-2] > 1 else mask
        mask = mask[..., cols] if mask.shape[-1] > 1 else mask
        out = out & (mask if mask.dtype == torch.bool else ~torch.isneginf(mask))
    if call.is_causal:
        out = out & (kv <= q)
    if call.mask_mod is not None:
        b, h, _, _ = index_grid(B, H, 1, 1, device=dev)
        out = out & evaluate_mask(call.mask_mod, b, h, q, kv)
    return out.expand(B, H, nr, nc).reshape(call.batch + (nr, nc))
