"""Empty sizes on every backend, with and without a trace, in every dtype (issue 25).

torch's CPU flash kernel dies of SIGFPE when B, H, T or S is 0, and ``return_trace=True`` on
the torch and auto backends called it, so the whole process went. Each backend's sweep runs
in a process of its own: a signal fails the test instead of killing pytest. One interpreter
imports torch and qkv (most of the start-up time, computing nothing) and forks a child per
backend. In the child every call is compared with the reference backend (shapes, values, the
trace, gradients).

Shape alphabet: B batch, H heads, T query length, S key length, D head dim, Dv value dim.
"""

from __future__ import annotations

import json
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


BACKENDS = ["torch", "auto", "tiled", "reference"]

# Forks a child per backend named in argv[2:] that runs SWEEP (argv[1]); prints one JSON line
# per backend: its exit code (negative: the signal that killed it) and what it printed.
_FORKER = textwrap.dedent("""
    import json, os, sys, traceback
    import torch, qkv

    sweep = sys.argv[1]
    for backend in sys.argv[2:]:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: stdout and stderr into the pipe, SWEEP's exit code out
            os.close(r)
            os.dup2(w, 1)
            os.dup2(w, 2)
            sys.argv = ["sweep", backend]
            code = 0
            try:
                exec(compile(sweep, "sweep", "exec"), {"__name__": "__main__"})
            except SystemExit as done:
                code = done.code if isinstance(done.code, int) else 1
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        os.close(w)
        with os.fdopen(r, errors="replace") as f:
            printed = f.read()
        _, status = os.waitpid(pid, 0)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        print(json.dumps(dict(backend=backend, code=code, printed=printed)), flush=True)
""")


@pytest.fixture(scope="module")
def sweeps() -> dict[str, dict]:
    """Each backend's sweep: ``{"code": exit code or -signal, "printed": its output}``."""
    run = subprocess.run(
        [sys.executable, "-c", _FORKER, SWEEP, *BACKENDS],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    found = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    return {r["backend"]: r for r in found}


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_sizes_never_kill_the_process(sweeps, backend):
    code, printed = sweeps[backend]["code"], sweeps[backend]["printed"]
    lines = [line for line in printed.strip().splitlines() if not line.startswith(" ")]
    last = lines[-1:] or ["(nothing printed)"]
    assert code >= 0, f"killed by {signal.Signals(-code).name} during: {last[0]}\n{printed[-2000:]}"
    assert code == 0, f"{last[0]}\n{printed[-3000:]}"
    assert "BAD []" in printed
