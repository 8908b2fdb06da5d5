"""A fresh interpreter for the checks that need one, at a fraction of the start-up.

Tests of what ``import qkv`` loads, or of a registration from scratch, cannot run in the test
process (it has imported everything already). ``subprocess.run([python, "-c", code])`` spends
~2 s of its ~2.5 s importing torch, each time. Here one server process imports torch once and
forks a child per call: the child holds torch and nothing of qkv, transformers, matplotlib or
the test process, as ``python -c "import torch; <code>"`` would. It computes nothing before it
forks (no thread pool exists yet), so each child starts clean.

``run(code)`` returns a ``subprocess.CompletedProcess`` like ``subprocess.run(..., text=True,
capture_output=True)``: the exit code (negative: the signal that ended the child), stdout and
stderr (the file descriptors: C libraries' output too).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

__all__ = ["as_subprocess_module", "forked_ranks", "run"]

_SERVER = textwrap.dedent("""
    import json, os, signal, sys, tempfile, time, traceback
    import torch  # the part of every start-up paid once

    def serve(request):
        out, err = (tempfile.TemporaryFile() for _ in range(2))
        pid = os.fork()
        if pid == 0:  # the child
            code = 0
            try:
                os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the requests are not its input
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                os.chdir(request["cwd"])
                os.environ.clear()
                os.environ.update(request["env"])
                sys.argv = ["-c", *request["argv"]]
                exec(compile(request["code"], "<string>", "exec"), {"__name__": "__main__"})
            except SystemExit as done:  # sys.exit(n), sys.exit(), sys.exit("message")
                code = done.code if isinstance(done.code, int) else 0 if done.code is None else 1
                if code == 1 and not isinstance(done.code, int):
                    print(done.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        deadline = time.monotonic() + request["timeout"]
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return dict(timeout=True)
            time.sleep(0.005)
        if os.WIFSIGNALED(status):
            returncode = -os.WTERMSIG(status)
        else:
            returncode = os.WEXITSTATUS(status)
        texts = []
        for f in (out, err):
            f.seek(0)
            texts.append(f.read().decode(errors="replace"))
            f.close()
        return dict(returncode=returncode, stdout=texts[0], stderr=texts[1])

    for line in sys.stdin:
        reply = serve(json.loads(line))
        sys.stdout.write(json.dumps(reply) + "\\n")
        sys.stdout.flush()
""")

_servers: list[subprocess.Popen] = []  # the one of this process, once started


def _start() -> subprocess.Popen:
    if not _servers or _servers[-1].poll() is not None:
        server = subprocess.Popen(
            [sys.executable, "-c", _SERVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        atexit.register(_stop, server)
        _servers.append(server)
    return _servers[-1]


def _stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        server.stdin.close()  # its loop ends: it exits
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()


def run(
    code: str,
    *argv: str,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    check: bool = False,
) -> subprocess.CompletedProcess:
    """``code`` run as ``python -c code *argv`` would run it, with ``env`` (default: this
    process's environment now) and this process's working directory."""
    server = _start()
    request = dict(
        code=code,
        argv=list(argv),
        env=dict(os.environ if env is None else env),
        cwd=os.getcwd(),
        timeout=timeout,
    )
    server.stdin.write(json.dumps(request) + "\n")
    server.stdin.flush()
    line = server.stdout.readline()
    if not line:
        raise RuntimeError(f"the fresh-interpreter server ended (exit code {server.poll()})")
    reply = json.loads(line)
    args = [sys.executable, "-c", code, *argv]
    if reply.get("timeout"):
        raise subprocess.TimeoutExpired(args, timeout)
    done = subprocess.CompletedProcess(args, reply["returncode"], reply["stdout"], reply["stderr"])
    if check:
        done.check_returncode()
    return done


def _run_command(cmd, *, env=None, timeout=None, check=False, **_capture_and_text):
    """``subprocess.run`` of a ``[python, "-c", code, *argv]`` command with ``capture_output``
    and ``text``, by :func:`run`; any other command as ``subprocess.run`` runs it."""
    if len(cmd) < 3 or cmd[0] != sys.executable or cmd[1] != "-c":
        return subprocess.run(cmd, env=env, timeout=timeout, check=check, **_capture_and_text)
    return run(cmd[2], *cmd[3:], env=env, timeout=timeout or 600, check=check)


def as_subprocess_module():
    """A stand-in for the ``subprocess`` module of a library file that starts
    ``python -c`` children (the benchmark runners, a fresh process per measurement): its
    ``run`` forks them from the server; its exceptions and classes are subprocess's own. A
    test sets it with ``monkeypatch.setattr(module, "subprocess", fresh.as_subprocess_module())``
    where the fresh process itself is checked elsewhere."""
    return SimpleNamespace(
        run=_run_command,
        TimeoutExpired=subprocess.TimeoutExpired,
        CompletedProcess=subprocess.CompletedProcess,
        CalledProcessError=subprocess.CalledProcessError,
    )


@contextlib.contextmanager
def forked_ranks():
    """``qkv.distributed.run_local``'s ranks forked from one server process that imported
    torch and qkv (multiprocessing's forkserver) instead of spawned afresh (2 s of imports a
    group of ranks). Each rank is still a process of its own that unpickles the function by
    name, joins the group and runs; the server computes nothing before it forks. For
    arguments holding few tensors: each tensor's memory goes to the rank as a file descriptor,
    and the forkserver passes at most 252 (test_context_parallel's state dicts pass more)."""
    from multiprocessing import forkserver

    import torch.multiprocessing as torch_mp

    from qkv.distributed import local

    server = forkserver._forkserver  # the process's one forkserver, started at first use
    preload = list(getattr(server, "_preload_modules", ["__main__"]))
    torch_mp.set_forkserver_preload(["torch", "qkv", "qkv.distributed"])
    forked = SimpleNamespace(get_context=lambda method="spawn": torch_mp.get_context("forkserver"))
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(local, "mp", forked)
            yield
    finally:  # nothing left behind: no server process, multiprocessing's preload list as it was
        if hasattr(server, "_stop"):
            server._stop()
        torch_mp.set_forkserver_preload(preload)
