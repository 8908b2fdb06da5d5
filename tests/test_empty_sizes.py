"""Empty sizes on every backend, with and without a trace, in every dtype (issue 25).

torch's CPU flash kernel dies of SIGFPE when B, H, T or S is 0, and ``return_trace=True`` on
the torch and auto backends called it, so the whole process went. Each backend's sweep runs
in a subprocess: a signal fails the test instead of killing pytest. In the subprocess every
call is compared with the reference backend (shapes, values, the trace, gradients).

Shape alphabet: B batch, H heads, T query length, S key length, D head dim, Dv value dim.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

SWEEP = textwrap.dedent("""
    import itertools, sys, torch, qkv
    backend = sys.argv[1]
    bases = [dict(B=1, H=1, T=3, S=3, D=4, Dv=4), dict(B=2, H=2, T=3, S=4, D=4, Dv=5)]
    bad = []
    for base, dim, dtype, trace, grad in itertools.product(
            bases, ["B", "H", "T", "S", "D", "Dv"],
            [torch.float32, torch.float64, torch.bfloat16, torch.float16],
            [False, True], [False, True]):
        n = dict(base, **{dim: 0})
        name = f"{backend} {n} {dtype} trace={trace} grad={grad}"
        print(name, flush=True)  # the last line printed names the call that killed us
        g = torch.Generator().manual_seed(0)
        shapes = [(n["B"], n["H"], n["T"], n["D"]), (n["B"], n["H"], n["S"], n["D"]),
                  (n["B"], n["H"], n["S"], n["Dv"])]
        ins = [torch.randn(s, generator=g).to(dtype) for s in shapes]
        results = []
        for be in (backend, "reference"):
            xs = [t.clone().requires_grad_(grad) for t in ins]
            try:
                res = qkv.scaled_dot_product_attention(*xs, backend=be, return_trace=trace)
            except qkv.BackendUnsupportedError:
                results.append(None)
                break
            out, tr = res if trace else (res, None)
            grads = torch.autograd.grad(out.float().sum(), xs) if grad else ()
            results.append((out, tr, grads))
        if results[0] is None:
            continue
        (out, tr, grads), (want, want_tr, want_grads) = results
        # half dtypes: rounding differs (the reference keeps a half call's lse in half, the
        # others in float32); D = 0 leaves rows that are not empty (a uniform average)
        tol = 1e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-6
        ok = out.shape == want.shape and out.dtype == want.dtype and torch.allclose(
            out.float(), want.float(), rtol=tol, atol=tol)
        if trace:
            for a, b in ((tr.lse, want_tr.lse), (tr.probs, want_tr.probs),
                         (tr.scores, want_tr.scores)):
                ok = ok and a.shape == b.shape and torch.allclose(a.float(), b.float(),
                                                                  rtol=tol, atol=tol)
        for a, b in zip(grads, want_grads):
            ok = ok and a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=tol,
                                                              atol=tol)
        if not ok:
            bad.append(name)
    print("BAD", bad)
    sys.exit(1 if bad else 0)
""")


@pytest.mark.parametrize("backend", ["torch", "auto", "tiled", "reference"])
def test_empty_sizes_never_kill_the_process(backend):
    run = subprocess.run(
        [sys.executable, "-c", SWEEP, backend],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    last = run.stdout.strip().splitlines()[-1:] or ["(nothing printed)"]
    assert run.returncode >= 0, (
        f"killed by {signal.Signals(-run.returncode).name} during: {last[0]}\n{run.stderr[-2000:]}"
    )
    assert run.returncode == 0, f"{last[0]}\n{run.stderr[-3000:]}"
    assert "BAD []" in run.stdout
