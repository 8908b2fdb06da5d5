"""A one-token decoding step of ``MultiHeadAttention`` by its kept plan (``qkv/nn/_step.py``,
issue 38): after a step by the module's way whose attention kept a lane of the few-rows
kernel, later steps run by the plan, to the bits of the module's way (outputs and the cache's
keys and values), and every change that the plan's checks stand for sends a step the module's
way: a gradient, another cache or a reset one, a key bucket crossed, another backend, a
replaced weight, a hook, dropout in training, the kernel switched off, autocast, another
thread. The module's way is a twin whose plan is dropped before each step.
"""

from __future__ import annotations

import copy
import pickle
import threading

import pytest
import torch
from routes import force_few_rows

import qkv
from qkv.ops import few_rows
from qkv.ops.base import BackendUnsupportedError

C, H = 32, 4


@pytest.fixture(autouse=True)
def _kernel_or_skip(monkeypatch):
    force_few_rows(monkeypatch, True)


@pytest.fixture
def planned(monkeypatch):
    """Count the plans' kernel calls from here on."""
    runs = [0]
    call = few_rows.Packed.__call__

    def counted(self, query, out, S):
        runs[0] += 1
        return call(self, query, out, S)

    monkeypatch.setattr(few_rows.Packed, "__call__", counted)
    return runs


def _pair(G=H, B=2, dtype=torch.float32, capacity=24, prompt=8, bias=True, padded=False):
    """A module decoding with the plan and its twin without, each with a cache holding the
    same prompt of ``prompt`` positions (``padded``: the last element's first 3 are padding,
    marked by a key mask: the cache is padded from then on)."""
    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(C, H, num_kv_heads=G, backend="tiled", bias=bias).eval()
    mha = mha.to(dtype)
    twin = copy.deepcopy(mha)
    x = torch.randn(B, prompt, C, generator=torch.Generator().manual_seed(1)).to(dtype)
    real = None
    if padded:
        real = torch.ones(B, prompt, dtype=torch.bool)
        real[-1, :3] = False
    caches = []
    with torch.no_grad():
        for m in (mha, twin):
            cache = m.new_cache(B, capacity)
            m(x, cache=cache, key_mask=real)
            caches.append(cache)
    return mha, twin, caches[0], caches[1]


def _twin_step(twin, x, cache):
    """The module's way: the twin's plan dropped first."""
    twin._kept_lane.held = None
    return twin(x, cache=cache)


def _same(a, b):
    """Equal to the bit, NaN where NaN."""
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def _steps(mha, twin, cache, twin_cache, n, B=2, seed=2, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randn(B, 1, C, generator=g).to(dtype)
        _same(mha(x, cache=cache), _twin_step(twin, x, twin_cache))
    assert cache.position == twin_cache.position
    _same(cache.keys, twin_cache.keys), _same(cache.values, twin_cache.values)


@pytest.mark.parametrize("G", [H, 2, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("padded", [False, True], ids=["plain", "padded"])
def test_planned_steps_give_the_bits_of_the_module_s_way(planned, G, dtype, B, padded):
    mha, twin, cache, twin_cache = _pair(G=G, B=B, dtype=dtype, padded=padded)
    assert cache._padded == padded
    with torch.no_grad():
        _steps(mha, twin, cache, twin_cache, 8, B=B, dtype=dtype)
    assert planned[0] == 7  # (the first step by the module's way makes the plan)


def test_a_planned_step_counts_its_writes_to_the_cache(planned):
    """The kernel writes the new key and value rows into the cache's buffers, and their
    version counters move as the module's way (``copy_``) moves them: a tensor autograd saved
    from the cache before the step is then found changed at backward, not read stale."""
    mha, twin, cache, twin_cache = _pair()
    with torch.no_grad():
        _steps(mha, twin, cache, twin_cache, 2)
    w = torch.ones((), requires_grad=True)
    saved = cache._k.narrow(2, 0, 9) * w  # (mul saves the cache's keys for backward)
    versions = cache._k._version, cache._v._version
    before = planned[0]
    with torch.no_grad():
        mha(torch.randn(2, 1, C), cache=cache)
    assert planned[0] == before + 1
    assert cache._k._version > versions[0] and cache._v._version > versions[1]
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.sum().backward()


def test_a_module_without_bias_plans_too(planned):
    mha, twin, cache, twin_cache = _pair(bias=False)
    with torch.no_grad():
        _steps(mha, twin, cache, twin_cache, 4)
    assert planned[0] == 3


def test_the_steps_match_one_causal_call_over_the_sequence(planned):
    torch.manual_seed(0)
    mha = qkv.MultiHeadAttention(C, H, num_kv_heads=2, backend="tiled").eval()
    x = torch.randn(2, 9, C)
    with torch.no_grad():
        whole = mha(x, is_causal=True)
        cache = mha.new_cache(2, 12)
        steps = torch.cat([mha(x[:, i : i + 1], cache=cache) for i in range(9)], 1)
    assert planned[0] == 9 - 5  # (the module's way at 1, 2, 3, 5 and 9 keys: new buckets)
    torch.testing.assert_close(steps, whole, rtol=1e-5, atol=1e-6)


def test_a_gradient_takes_the_module_s_way(planned):
    mha, twin, cache, twin_cache = _pair()
    with torch.no_grad():
        _steps(mha, twin, cache, twin_cache, 2)
    before = planned[0]
    x = torch.randn(2, 1, C)
    out = mha(x, cache=cache)  # (grad on: the weights want one)
    assert out.requires_grad and planned[0] == before
    assert torch.equal(out.detach(), _twin_step(twin, x, twin_cache).detach())


def test_another_cache_or_a_reset_one_takes_the_module_s_way(planned):
    mha, twin, cache, twin_cache = _pair()
    other, twin_other = mha.new_cache(2, 24), twin.new_cache(2, 24)
    with torch.no_grad():
        _steps(mha, twin, cache, twin_cache, 3)
        _steps(mha, twin, other, twin_other, 3)  # (a plan of its own made, then used)
        _steps(mha, twin, cache, twin_cache, 3)  # (and back)
        # 9-11 keys: the way, then the plan twice; the new cache's 1, 2 and 3 keys: each a new
        # bucket, the way; back at 12-14 keys: the way (a plan of the other cache), the plan
        assert planned[0] == 2 + 0 + 2
        cache.reset(), twin_cache.reset()
        _steps(mha, twin, cache, twin_cache, 3)


def test_a_bucket_crossed_makes_a_new_plan(planned):
    """Key counts 5..20 cross the bucket (8, 16]: the lane is measured and kept again."""
    mha, twin, cache, twin_cache = _pair(prompt=5)
    with torch.no_grad():
        _steps(mha, twin, cache, twin_cache, 16)
    assert planned[0] == 16 - 3  # (steps to 6 keys, to 9 and to 17: the module's way)


def test_a_full_cache_raises_as_the_module_s_way_does(planned):
    mha, twin, cache, twin_cache = _pair(capacity=10)
    with torch.no_grad():
        _steps(mha, twin, cache, twin_cache, 2)
        with pytest.raises(ValueError, match="KVCache is full"):
            mha(torch.randn(2, 1, C), cache=cache)
    assert cache.position == 10


@pytest.mark.parametrize("change", ["backend", "weight", "hook", "dropout", "switch", "autocast"])
def test_a_change_takes_the_module_s_way(planned, monkeypatch, change):
    mha, twin, cache, twin_cache = _pair()
    x = torch.randn(2, 1, C)
    with torch.no_grad():
        _steps(mha, twin, cache, twin_cache, 2)
        before = planned[0]
        seen = []
        if change == "backend":
            mha.backend = twin.backend = "reference"
        elif change == "weight":
            w = torch.nn.Parameter(mha.in_proj_weight * 2)
            mha.in_proj_weight, twin.in_proj_weight = w, copy.deepcopy(w)
        elif change == "hook":
            mha.out_proj.register_forward_hook(lambda m, i, o: seen.append(o.shape))
        elif change == "dropout":  # (tiled has none: the module's way says so)
            mha.dropout = twin.dropout = 0.5
            mha.train(), twin.train()
        elif change == "switch":
            monkeypatch.setenv(few_rows.SWITCH, "off")
        if change == "dropout":
            for m, c in ((mha, cache), (twin, twin_cache)):
                with pytest.raises(BackendUnsupportedError, match="tiled has no dropout"):
                    m(x, cache=c)
            out = ref = torch.zeros(())
        else:
            with torch.autocast("cpu", enabled=change == "autocast"):
                out, ref = mha(x, cache=cache), _twin_step(twin, x, twin_cache)
        assert planned[0] == before and torch.equal(out, ref)
        assert seen == ([(2, 1, C)] if change == "hook" else [])


def test_an_update_of_the_weights_in_place_keeps_the_plan(planned):
    """An optimizer's step writes the same parameters: the plan runs and reads them."""
    mha, twin, cache, twin_cache = _pair()
    with torch.no_grad():
        _steps(mha, twin, cache, twin_cache, 2)
        for m in (mha, twin):
            m.in_proj_weight.mul_(0.5), m.out_proj.bias.add_(1.0)
        before = planned[0]
        _steps(mha, twin, cache, twin_cache, 2)
    assert planned[0] == before + 2


def test_another_thread_takes_the_module_s_way(planned):
    mha, twin, cache, twin_cache = _pair()
    x = torch.randn(2, 1, C)
    with torch.no_grad():
        _steps(mha, twin, cache, twin_cache, 2)
    before, got = planned[0], []

    def step():
        with torch.no_grad():
            got.append(mha(x, cache=cache))

    thread = threading.Thread(target=step)
    thread.start(), thread.join()
    assert planned[0] == before
    with torch.no_grad():
        assert torch.equal(got[0], _twin_step(twin, x, twin_cache))


def test_nan_and_inf_in_the_cache_meet_the_contract_as_the_module_s_way(planned):
    mha, twin, cache, twin_cache = _pair()
    with torch.no_grad():
        _steps(mha, twin, cache, twin_cache, 2)
        for c in (cache, twin_cache):
            c._k[0, 1, 2, 3], c._v[1, 0, 4, 5] = float("inf"), float("nan")
        _steps(mha, twin, cache, twin_cache, 2)
        out = mha(torch.randn(2, 1, C), cache=cache)
    assert out[1].isnan().all()  # (a value NaN: head 0's rows NaN, W^O mixes it in everywhere)
    assert planned[0] == 4


def test_copies_and_pickles_of_a_module_plan_their_own(planned):
    mha, twin, cache, twin_cache = _pair()
    with torch.no_grad():
        _steps(mha, twin, cache, twin_cache, 2)
    assert mha._kept_lane.held is not None
    for made in (copy.deepcopy(mha), pickle.loads(pickle.dumps(mha))):
        assert made._kept_lane.held is None
        made_cache = made.new_cache(2, 8)
        with torch.no_grad():
            made(torch.randn(2, 3, C), cache=made_cache)
            made(torch.randn(2, 1, C), cache=made_cache)
        assert made._kept_lane.held is not None and made._kept_lane.held.keys() is made_cache._k


def test_the_kernel_switched_off_and_on_again_plans_again(planned, monkeypatch):
    """A lane kept while ``QKV_FEW_ROWS=off`` (not the kernel's, or none) is not kept once the
    switch is back: the steps plan again, those of new modules at key counts whose exact kinds
    kept lanes while off too (their kind's lane, kept now, is found under them)."""
    mha, twin, cache, twin_cache = _pair()
    with torch.no_grad():
        monkeypatch.setenv(few_rows.SWITCH, "off")
        _steps(mha, twin, cache, twin_cache, 3)  # (9, 10 and 11 keys)
        assert planned[0] == 0
        monkeypatch.delenv(few_rows.SWITCH)
        others = _pair(prompt=9)  # (10 keys first: an exact kind kept while off)
        _steps(*others, 3)
        assert planned[0] == 2
        _steps(mha, twin, cache, twin_cache, 3)
    assert planned[0] == 4


def test_a_key_mask_step_then_plain_steps_plan_over_the_padded_cache(planned):
    """A step with ``key_mask`` runs the module's way and marks the cache padded: the next
    step runs the module's way too (a plan of the padded cache made: the kernel reads its
    mask in place), the ones after by it; a reset makes the cache plain again."""
    mha, twin, cache, twin_cache = _pair()
    real = torch.tensor([[True], [False]])  # (B, 1): element 1's new token is padding
    x = torch.randn(2, 1, C)
    with torch.no_grad():
        _steps(mha, twin, cache, twin_cache, 2)
        before = planned[0]
        _same(mha(x, cache=cache, key_mask=real), twin(x, cache=twin_cache, key_mask=real))
        assert planned[0] == before and cache._padded
        _steps(mha, twin, cache, twin_cache, 3)
        assert planned[0] == before + 2
        cache.reset(), twin_cache.reset()
        _steps(mha, twin, cache, twin_cache, 9)  # (1 to 9 keys: the buckets' firsts the way)
    assert planned[0] == before + 2 + 9 - 5


def test_inference_mode_steps_plan_too(planned):
    mha, twin, cache, twin_cache = _pair()
    with torch.inference_mode():
        _steps(mha, twin, cache, twin_cache, 4)
    assert planned[0] == 3


def test_a_dropped_cache_is_freed_though_a_plan_was_made_over_it(planned):
    """The plan holds the cache's buffers weakly: dropping the cache frees them, and a step
    over a new cache runs the module's way (then plans again)."""
    import gc
    import weakref

    mha, twin, cache, twin_cache = _pair()
    with torch.no_grad():
        _steps(mha, twin, cache, twin_cache, 3)
    assert mha._kept_lane.held is not None
    gone = weakref.ref(cache._k)
    del cache
    gc.collect()
    assert gone() is None
    fresh, twin_fresh = mha.new_cache(2, 24), twin.new_cache(2, 24)
    with torch.no_grad():
        _steps(mha, twin, fresh, twin_fresh, 3)
        old = weakref.ref(mha.in_proj_weight)  # (a replaced weight is freed too)
        mha.in_proj_weight = torch.nn.Parameter(mha.in_proj_weight.detach().clone())
    gc.collect()
    assert old() is None and mha._kept_lane.held is not None


def test_a_planned_step_reads_nothing_on_the_host(planned):
    """Counted as ``test_host_reads`` counts (the ops that move a value to the host)."""
    from test_host_reads import count_reads

    mha, twin, cache, twin_cache = _pair()
    with torch.no_grad():
        _steps(mha, twin, cache, twin_cache, 2)
        before = planned[0]
        x = torch.randn(2, 1, C)
        assert count_reads(lambda: mha(x, cache=cache)) == []
    assert planned[0] == before + 1


def test_nan_in_a_padded_cache_s_hidden_keys_changes_nothing(planned):
    mha, twin, cache, twin_cache = _pair(padded=True)
    with torch.no_grad():
        _steps(mha, twin, cache, twin_cache, 2)
        for c in (cache, twin_cache):  # (element 1's first 3 positions are padding)
            c._k[1, :, :3], c._v[1, :, :3] = float("nan"), float("inf")
        before = planned[0]
        _steps(mha, twin, cache, twin_cache, 3)
        out = mha(torch.randn(2, 1, C), cache=cache)
    assert planned[0] == before + 4 and out.isfinite().all()
