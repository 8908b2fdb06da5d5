"""qkv.distributed.ring_attention against single-process attention, on real processes.

Each group of ranks is spawned once (``run_local``: gloo on loopback, bounded time) and runs
every case of a table; the parent then compares each rank's shards with the reference backend
on the whole sequence: float64 with assert_close defaults, float32/bfloat16 by the tolerance
policy, outputs and gradients. Cases draw what users pass: T not divisible by the ranks, a rank
with no positions, cross-attention T != S, GQA, both layouts, windows, documents, key lengths,
score mods, plain-function masks, fully masked rows. The message logs show that a shard the
mask leaves empty for a rank is never sent to it.
"""

from __future__ import annotations

import time

import fresh
import pytest
import torch

import qkv
from qkv.distributed import RankFailed, run_local, segments
from qkv.distributed.layout import assemble
from qkv.testing import GRAD_FACTOR, OUTPUT_FACTOR, assert_tolerance

D = 8


@pytest.fixture(scope="module", autouse=True)
def _forked_ranks():
    """The ranks forked from a server that imported torch and qkv (tests/fresh.py)."""
    with fresh.forked_ranks():
        yield


def _third(b, h, q_idx, kv_idx):  # a plain-function mask: nothing known about its blocks
    return (q_idx + 2 * kv_idx) % 3 != 0


def _bias_fn(score, b, h, q_idx, kv_idx):  # a plain-function score_mod of positions
    return score + 0.05 * (q_idx - kv_idx).abs().to(score.dtype).sqrt()


CASES = {
    # name: sizes, layout and what the call passes
    "dense": dict(T=37),
    "dense-balanced": dict(T=37, layout="balanced"),
    "causal": dict(T=37, causal=True),
    "causal-balanced": dict(T=41, causal=True, layout="balanced"),
    "gqa-causal": dict(T=30, H=4, G=2, causal=True),
    "gqa-balanced": dict(T=30, H=6, G=2, causal=True, layout="balanced"),
    "window": dict(T=64, mask="window5"),
    "window-sym-balanced": dict(T=50, mask="window3x3", layout="balanced"),
    "document": dict(T=48, mask="document"),
    "document-balanced": dict(T=48, mask="document", layout="balanced"),
    "key-lengths": dict(T=33, mask="key_lengths", B=3),
    "fully-masked-rows": dict(T=20, mask="no_keys_b0", B=2),
    "alibi-causal": dict(T=35, H=4, causal=True, score="alibi"),
    "softcap-window": dict(T=40, mask="window5", score="softcap"),
    "plain-functions": dict(T=27, mask="fn", score="fn"),
    "cross-bottom-right": dict(T=29, S=41, mask="causal_br"),
    "cross-dense-balanced": dict(T=22, S=31, layout="balanced"),
    "uneven-shards": dict(T=31, lengths=True, causal=True),
    "tiny": dict(T=2, causal=True),  # some ranks hold nothing
    "scale-dv": dict(T=25, Dv=5, scale=0.3, mask="window5"),
    "trace": dict(T=23, causal=True, trace=True, layout="balanced"),
    "learned-slopes": dict(T=26, H=2, causal=True, score="learned_alibi"),
    "float32-window": dict(T=96, mask="window5", dtype=torch.float32),
    "bfloat16-causal": dict(T=80, causal=True, dtype=torch.bfloat16, layout="balanced"),
}


def _sizes(case):
    T = case["T"]
    return dict(
        B=case.get("B", 2),
        H=case.get("H", 2),
        G=case.get("G", case.get("H", 2)),
        T=T,
        S=case.get("S", T),
        Dv=case.get("Dv", D),
    )


def _lengths(L: int, R: int) -> list[int]:
    """An uneven contiguous cut: the middle rank holds most."""
    base = [max(1, L // (3 * R))] * R
    base[R // 2] += L - sum(base)
    return base


def _runs(case, L: int, R: int) -> list[list[tuple[int, int]]]:
    if case.get("lengths"):
        n = _lengths(L, R)
        starts = [sum(n[:r]) for r in range(R)]
        return [[(a, a + m)] for a, m in zip(starts, n)]
    return segments(L, R, case.get("layout", "contiguous"))


def _take(x, runs, dim=-2):
    return torch.cat([x.narrow(dim, a, b - a) for a, b in runs], dim=dim)


def _inputs(name, case):
    s = _sizes(case)
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    dt = case.get("dtype", torch.float64)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dt)

    q, k = r(s["B"], s["H"], s["T"], D), r(s["B"], s["G"], s["S"], D)
    v, dout = r(s["B"], s["G"], s["S"], s["Dv"]), r(s["B"], s["H"], s["T"], s["Dv"])
    # documents 0, 1, 2 in runs: on 3 ranks of 16, the first and last shards share none
    runs = [(10, 20, 18), (5, 25, 18)][: s["B"]]
    ids = torch.stack([torch.repeat_interleave(torch.arange(3), torch.tensor(n)) for n in runs])
    ids = ids[:, : s["T"]] if ids.shape[1] >= s["T"] else None
    return q, k, v, dout, ids


def _call_args(case, ids, slopes=None):
    """The keyword arguments both sides pass (masks over whole-sequence positions)."""
    s = _sizes(case)
    kw = dict(
        is_causal=case.get("causal", False), enable_gqa=s["H"] != s["G"], scale=case.get("scale")
    )
    mask = case.get("mask")
    masks = {
        "window5": lambda: qkv.masks.sliding_window(5),
        "window3x3": lambda: qkv.masks.sliding_window(3, 3),
        "document": lambda: qkv.masks.document(ids),
        "key_lengths": lambda: qkv.masks.key_lengths(torch.tensor([s["S"], 7, 19][: s["B"]])),
        "no_keys_b0": lambda: qkv.masks.key_lengths(torch.tensor([0, 9])),
        "fn": lambda: _third,
        "causal_br": lambda: qkv.masks.causal("bottom_right"),
    }
    scores = {
        "alibi": lambda: qkv.masks.alibi(s["H"]),
        "softcap": lambda: qkv.masks.softcap(2.0),
        "fn": lambda: _bias_fn,
        "learned_alibi": lambda: qkv.masks.alibi(slopes),
    }
    kw["mask_mod"] = masks[mask]() if mask else None
    kw["score_mod"] = scores[case["score"]]() if case.get("score") else None
    return kw


def _slopes():
    return torch.tensor([0.5, 0.25], dtype=torch.float64)


def _run_cases(rank, R, names):
    from qkv.distributed import comm_log, ring_attention

    results = {}
    for name in names:
        case = CASES[name]
        q, k, v, dout, ids = _inputs(name, case)
        layout = case.get("layout", "contiguous")
        q_runs, kv_runs = _runs(case, q.shape[2], R)[rank], _runs(case, k.shape[2], R)[rank]
        ql, kl, vl = (
            _take(t, runs).requires_grad_() for t, runs in ((q, q_runs), (k, kv_runs), (v, kv_runs))
        )
        slopes = _slopes().requires_grad_() if case.get("score") == "learned_alibi" else None
        kw = _call_args(case, ids, slopes)
        with comm_log() as log:
            res = ring_attention(
                ql, kl, vl, layout=layout, return_trace=case.get("trace", False), timeout=60, **kw
            )
            out, trace = res if case.get("trace") else (res, None)
            out.backward(_take(dout, q_runs))
        results[name] = dict(
            out=out.detach(),
            dq=ql.grad,
            dk=kl.grad,
            dv=vl.grad,
            dslopes=None if slopes is None else slopes.grad,
            probs=None if trace is None else trace.probs,
            lse=None if trace is None else trace.lse,
            sent={ph: sorted(log.peers("send", ph)) for ph in ("forward", "backward", "gradients")},
            received={
                ph: sorted(log.peers("recv", ph)) for ph in ("forward", "backward", "gradients")
            },
            bytes_sent=log.bytes("send", "forward"),
        )
    results["second derivative"] = _second_derivative_refused(ring_attention)
    return results


def _second_derivative_refused(ring_attention) -> str:
    """What asking the ring for a second derivative says (its passes build no graph)."""
    q, k, v = (torch.randn(1, 2, 6, D, dtype=torch.float64, requires_grad=True) for _ in "qkv")
    out = ring_attention(q, k, v, is_causal=True, timeout=60)
    try:  # a gradient penalty: without the refusal, its term was silently left out
        (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
        torch.autograd.grad(out.sum() + dq.square().sum(), k)
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.fixture(scope="module")
def ran():
    """Every case on 2 and on 3 ranks (one process group each)."""
    return {R: run_local(_run_cases, R, list(CASES), timeout=300) for R in (2, 3)}


def _reference(name, case):
    q, k, v, dout, ids = _inputs(name, case)
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    slopes = _slopes().requires_grad_() if case.get("score") == "learned_alibi" else None
    kw = _call_args(case, ids, slopes)
    out, trace = qkv.scaled_dot_product_attention(
        q, k, v, backend="reference", return_trace=True, **kw
    )
    out.backward(dout.double())
    return dict(
        out=out.detach(),
        dq=q.grad,
        dk=k.grad,
        dv=v.grad,
        probs=trace.probs,
        lse=trace.lse,
        dslopes=None if slopes is None else slopes.grad,
    )


def _baseline(name, case):
    """The reference in the case's dtype (the tolerance policy's baseline)."""
    q, k, v, dout, ids = _inputs(name, case)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = qkv.scaled_dot_product_attention(q, k, v, backend="reference", **_call_args(case, ids))
    out.backward(dout)
    return dict(out=out.detach(), dq=q.grad, dk=k.grad, dv=v.grad)


def _whole(results, name, key, case, R, which="q"):
    parts = [results[r][name][key] for r in range(R)]
    s = _sizes(case)
    L = s["T"] if which == "q" else s["S"]
    return assemble(parts, _runs(case, L, R))


@pytest.mark.parametrize("R", [2, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_ring_equals_single_process(ran, name, R):
    case = CASES[name]
    got = {
        key: _whole(ran[R], name, key, case, R, which)
        for key, which in (("out", "q"), ("dq", "q"), ("dk", "kv"), ("dv", "kv"))
    }
    ref = _reference(name, case)
    dt = case.get("dtype", torch.float64)
    if dt == torch.float64:
        for key in got:
            torch.testing.assert_close(
                got[key], ref[key], msg=lambda m, key=key: f"{name} {key}: {m}"
            )
    else:
        base = _baseline(name, case)
        for key in got:
            assert got[key].dtype == dt
            assert_tolerance(
                got[key],
                ref[key],
                base[key],
                name=f"{name} {key}",
                factor=OUTPUT_FACTOR if key == "out" else GRAD_FACTOR,
            )
    if name == "fully-masked-rows":  # batch element 0 has no key: 0 out, 0 gradients
        assert torch.equal(got["out"][0], torch.zeros_like(got["out"][0]))
        assert torch.equal(got["dq"][0], torch.zeros_like(got["dq"][0]))


@pytest.mark.parametrize("R", [2, 3])
def test_learned_score_tensor_gets_its_gradient_summed_over_ranks(ran, R):
    """Each rank's gradient of a shared score_mod tensor is its rows' share: the sum over the
    ranks (what DDP's all-reduce forms) is the single-process gradient."""
    ref = _reference("learned-slopes", CASES["learned-slopes"])
    total = sum(ran[R][r]["learned-slopes"]["dslopes"] for r in range(R))
    torch.testing.assert_close(total, ref["dslopes"])
    assert all(ran[R][r]["learned-slopes"]["dslopes"].abs().sum() > 0 for r in range(R))


@pytest.mark.parametrize("R", [2, 3])
def test_trace_gives_this_ranks_rows_of_the_whole_weights(ran, R):
    case = CASES["trace"]
    ref = _reference("trace", case)
    runs = _runs(case, case["T"], R)
    for r in range(R):
        mine = ran[R][r]["trace"]
        torch.testing.assert_close(mine["probs"], _take(ref["probs"], runs[r]))
        torch.testing.assert_close(
            mine["lse"], _take(ref["lse"].unsqueeze(-1), runs[r]).squeeze(-1)
        )
        assert mine["probs"].shape[-1] == case["T"]  # every key, from every rank


def test_a_second_derivative_is_refused_not_silently_wrong(ran):
    for R in (2, 3):
        for rank in range(R):
            said = ran[R][rank]["second derivative"]
            assert "ring_attention has no second derivative" in said, said


def test_window_sends_only_the_window_to_the_next_rank(ran):
    """A causal window of 5 with shards of 21+ positions: rank r needs only the last 5 keys of
    rank r-1, so it sends those (not its shard: O(W), not O(T / R)) to r+1 alone, once
    forward and once backward, and gets their gradients back from r+1 alone."""
    for R in (2, 3):
        for r in range(R):
            got = ran[R][r]["window"]
            nxt = [r + 1] if r + 1 < R else []
            prev = [r - 1] if r > 0 else []
            assert got["sent"] == {"forward": nxt, "backward": nxt, "gradients": prev}, (R, r)
            assert got["received"] == {"forward": prev, "backward": prev, "gradients": nxt}, (R, r)
            window_bytes = 2 * 2 * 5 * 2 * D * 8  # B, G, 5 positions, K and V, float64
            assert got["bytes_sent"] == (window_bytes if nxt else 0)


def test_causal_contiguous_never_sends_backwards(ran):
    """Under a causal mask (contiguous shards) no rank needs a later rank's keys."""
    for R in (2, 3):
        for r in range(R):
            got = ran[R][r]["causal"]
            assert got["sent"]["forward"] == list(range(r + 1, R))
            assert got["received"]["forward"] == list(range(r))


def test_documents_send_only_to_ranks_sharing_a_document(ran):
    """Pairs of shards with no document in common are neither sent nor received."""
    case = CASES["document"]
    *_, ids = _inputs("document", case)
    for R in (2, 3):
        runs = _runs(case, case["T"], R)
        docs = [set(_take(ids, rr, dim=-1).flatten().tolist()) for rr in runs]
        for r in range(R):
            want = sorted(s for s in range(R) if s != r and docs[s] & docs[r])
            assert ran[R][r]["document"]["sent"]["forward"] == want
        if R == 3:  # the case is built so that some pair shares nothing
            assert any(not (docs[a] & docs[b]) for a in range(R) for b in range(R))


# --- refusals and failures ---------------------------------------------------------------------


def _refusals(rank, R):
    from qkv.distributed import ring_attention

    q = torch.randn(1, 2, 5, D, dtype=torch.float64)
    found = {}

    def attempt(name, fn):
        try:
            fn()
            found[name] = None
        except Exception as err:  # the message goes back to the parent
            found[name] = f"{type(err).__name__}: {err}"

    # every rank raises the same error, so none is left waiting
    attempt(
        "dtype",
        lambda: ring_attention(
            q if rank else q.float(), q if rank else q.float(), q if rank else q.float(), timeout=20
        ),
    )
    bad = q.clone()
    bad[0, 0, 0, 0] = float("nan") if rank == R - 1 else 0.0
    attempt("nan", lambda: ring_attention(bad, bad, bad, timeout=20))
    uneven = torch.randn(1, 2, 4 + rank, D)
    attempt(
        "balanced", lambda: ring_attention(uneven, uneven, uneven, layout="balanced", timeout=20)
    )
    attempt("layout", lambda: ring_attention(q, q, q, layout="zigzag"))
    attempt("3d", lambda: ring_attention(q[0], q[0], q[0]))
    attempt("heads", lambda: ring_attention(q, q[:, :1], q[:, :1]))
    ok = ring_attention(q, q, q, timeout=20)  # the group still works after the refusals
    found["ok"] = tuple(ok.shape)
    return found


def test_bad_calls_raise_the_same_clear_error_on_every_rank():
    results = run_local(_refusals, 2, timeout=120)
    for found in results:
        assert "disagree on dtype" in found["dtype"] and "float32" in found["dtype"]
        assert "NaN or inf" in found["nan"] and "ranks [1]" in found["nan"]
        assert (
            "balanced" in found["balanced"]
            and "shard(x, group, layout='balanced')" in found["balanced"]
        )
        assert found["layout"].startswith("ValueError") and "zigzag" in found["layout"]
        assert "4-D" in found["3d"]
        assert "enable_gqa=True" in found["heads"]
        assert found["ok"] == (1, 2, 5, D)


def _one_rank_stays_away(rank, R, done):
    from pathlib import Path

    from qkv.distributed import PeerError, ring_attention

    if rank == 1:  # never calls ring_attention; stays until rank 0 has given up (at most 30 s)
        deadline = time.monotonic() + 30
        while not Path(done).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return "away"
    q = torch.randn(1, 1, 6, D)
    start = time.monotonic()
    try:
        ring_attention(q, q, q, timeout=2)
    except PeerError as err:
        return (time.monotonic() - start, str(err))
    finally:
        Path(done).touch()
    return "no error"


def test_a_rank_that_does_not_answer_makes_the_others_fail_within_the_timeout(tmp_path):
    done = str(tmp_path / "rank-0-returned")
    waited, message = run_local(_one_rank_stays_away, 2, done, timeout=120)[0]
    assert waited < 10
    assert "did not complete within 2 s" in message and "a rank died" in message


def _dies(rank, R):
    import os

    import torch.distributed as dist

    from qkv.distributed import ring_attention

    dist.barrier()  # the group formed on both ranks: rank 1 dies after, not during, rank 0's
    # init (which then failed with gloo's own error, once in a suite run of 2026-11-27)
    if rank == 1:
        os._exit(7)
    q = torch.randn(1, 1, 6, D)
    return ring_attention(q, q, q, timeout=5)


def test_a_rank_that_dies_fails_the_run_with_both_stories():
    start = time.monotonic()
    with pytest.raises(RankFailed) as err:
        run_local(_dies, 2, timeout=120, grace=30)
    assert time.monotonic() - start < 60
    text = str(err.value)
    assert "rank 1: died with exit code 7" in text
    assert "PeerError" in text and "shard sizes" in text


def test_without_a_process_group_the_error_says_how_to_start_one():
    q = torch.randn(1, 1, 4, D)
    with pytest.raises(RuntimeError, match="torchrun"):
        qkv.distributed.ring_attention(q, q, q)
    with pytest.raises(RuntimeError, match="init_process_group"):
        qkv.distributed.shard(q)


# --- shard / unshard ----------------------------------------------------------------------------


def _shard_roundtrip(rank, R):
    from qkv.distributed import shard, unshard

    x = torch.arange(2 * 11 * 3, dtype=torch.float64).view(2, 11, 3)
    out = {}
    for layout in ("contiguous", "balanced"):
        mine = shard(x.clone().requires_grad_(), dim=1, layout=layout)
        whole = unshard(mine, dim=1, layout=layout)
        (whole * (rank + 1)).sum().backward()  # every rank's copy has its own loss
        out[layout] = dict(mine=mine.detach(), whole=whole.detach())
    leaf = x.clone().requires_grad_()
    mine = shard(leaf, dim=1, layout="balanced")
    unshard(mine, dim=1, layout="balanced").pow(2).sum().backward()
    out["grad"] = leaf.grad
    return out


def test_shard_unshard_round_trip_and_gradients():
    x = torch.arange(2 * 11 * 3, dtype=torch.float64).view(2, 11, 3)
    R = 3
    results = run_local(_shard_roundtrip, R, timeout=120)
    for layout in ("contiguous", "balanced"):
        runs = segments(11, R, layout)
        for r in range(R):
            assert torch.equal(results[r][layout]["mine"], _take(x, runs[r], dim=1))
            assert torch.equal(results[r][layout]["whole"], x)
    # balanced: rank 0 holds chunks 0 and 5 of 6 (positions 0-1 and 10), rank 2 chunks 2 and 3
    assert segments(11, 3, "balanced") == [[(0, 2), (10, 11)], [(2, 4), (8, 10)], [(4, 6), (6, 8)]]
    # d/dx of sum over ranks of sum(unshard(shard(x))^2) = R * 2x on each rank's positions
    for r in range(R):
        runs = segments(11, R, "balanced")[r]
        got = _take(results[r]["grad"], runs, dim=1)
        torch.testing.assert_close(got, R * 2 * _take(x, runs, dim=1))


def test_segments_cover_the_sequence_once():
    for L in (0, 1, 2, 7, 16, 37):
        for R in (1, 2, 3, 4):
            for layout in ("contiguous", "balanced"):
                runs = segments(L, R, layout)
                pos = [p for rr in runs for a, b in rr for p in range(a, b)]
                assert sorted(pos) == list(range(L)), (L, R, layout)
                sizes = [sum(b - a for a, b in rr) for rr in runs]
                assert max(sizes) - min(sizes) <= (1 if layout == "contiguous" else 2)


def test_an_error_while_posting_tells_the_same_story_as_one_while_waiting():
    """gloo may raise while posting a collective when a peer is already gone ("Connection
    closed by peer"); that raised a bare RuntimeError instead of the PeerError that names what
    was waited for (test_a_rank_that_dies... failed about once in a loaded suite run)."""
    from qkv.distributed import PeerError, comm

    def post():
        raise RuntimeError("Connection closed by peer [127.0.0.1]:1234")

    with pytest.raises(PeerError, match=r"shard sizes did not complete within 5 s.*Connection"):
        comm.wait(post, 5, "ring_attention's exchange of shard sizes")
