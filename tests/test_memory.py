"""qkv.ops._memory.empty_large: huge-page advice on whole 2 MiB pages inside a large CPU
tensor, nothing for small or non-CPU tensors, and a tensor like any other."""

from __future__ import annotations

import torch

from qkv.ops import _memory


def _record(monkeypatch):
    calls = []
    monkeypatch.setattr(
        _memory,
        "_MADVISE",
        lambda start, length, advice: calls.append((start, length, advice)) or 0,
    )
    return calls


def test_advice_covers_whole_huge_pages_inside_the_tensor(monkeypatch):
    calls = _record(monkeypatch)
    t = _memory.empty_large((3, 1000, 1001), dtype=torch.float32, device=torch.device("cpu"))
    assert t.shape == (3, 1000, 1001) and t.dtype == torch.float32 and t.is_contiguous()
    ((start, length, advice),) = calls
    page = 2 << 20
    lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * 4
    assert advice == 14 and start % page == 0 and length % page == 0
    assert (
        lo <= start and start + length <= hi and start - lo < page and hi - (start + length) < page
    )
    t.fill_(2.5)  # usable as any tensor
    assert t.sum().item() == 2.5 * t.numel()


def test_small_and_non_cpu_tensors_get_no_advice(monkeypatch):
    calls = _record(monkeypatch)
    _memory.empty_large((1000, 1000), dtype=torch.float32, device=torch.device("cpu"))  # 4 MB
    _memory.empty_large((3000, 3000), dtype=torch.float32, device=torch.device("meta"))
    assert calls == []


def test_without_madvise_it_is_torch_empty(monkeypatch):
    monkeypatch.setattr(_memory, "_MADVISE", None)
    t = _memory.empty_large((2048, 2048), dtype=torch.bfloat16, device=torch.device("cpu"))
    assert t.shape == (2048, 2048) and t.dtype == torch.bfloat16
