"""The training loop behind ``qkv train``: seeded, checkpointed, resumable to the bit, on one
process or data-parallel on several (torchrun).

What a task supplies is a :class:`Recipe` (build the model, make a batch from example indices,
the loss and its metrics, the evaluation, the pictures); this module owns everything else:

* **Determinism.** The model is built after ``torch.manual_seed(seed)``; the batch of step s
  is a slice of a permutation drawn from ``seed`` and the epoch alone, so it does not depend
  on what ran before; the random number generators dropout draws from (every rank's) are
  saved with every checkpoint. A run resumed from a checkpoint ends with the same parameters
  and loss, bit for bit, on CPU, on one process or several.
* **Checkpoints** every ``checkpoint_every`` steps and at the end, written atomically (a
  temporary file in the same directory, then ``os.replace``): a write killed half-way leaves
  the previous checkpoint intact.
* **Ctrl-C** finishes the current step, writes a checkpoint and stops (a second Ctrl-C stops at
  once); ``resume=True`` continues from it.
* A progress bar with loss, accuracy and tokens/s; ``metrics.json`` (atomic) at the end,
  written before the pictures are drawn (without matplotlib: no pictures, one warning line).
* **No trace left**: torch's global settings (threads, RNG, grad mode, default dtype) are
  restored when :func:`train` returns; an output folder it made for a run that fails before
  writing in it is removed again; its files get the umask's permissions like any other.

**Data parallel.** Under torchrun (``WORLD_SIZE`` > 1 in the environment; ``qkv train --nproc
N`` starts it) every process calls :func:`train` alike; it makes the process group itself
(gloo on CPU, NCCL for ``device="cuda"``, rank r on ``cuda:LOCAL_RANK``; a ``timeout`` so a
rank that dies or hangs makes the others raise :class:`ConnectionError` instead of waiting
forever) and destroys it at the end (:mod:`qkv.training.parallel`).

* ``batch_size`` is the **global** batch: each of the N ranks takes every N-th example of the
  step's indices (the same indices as one process draws), so N processes see the examples one
  process sees; a batch size N does not divide is refused. The model is wrapped in
  ``DistributedDataParallel``; each rank's loss is weighted by its share of the loss's terms
  (``Recipe.loss_count``: tokens for a token-level loss, else examples), so the averaged
  gradient is the gradient of the mean over the global batch, as one process computes it.
* Loss, accuracy and tokens/s are summed over the ranks (the means weighted by the same
  counts). The ranks share the evaluation: rank r takes every N-th test batch from r
  (``Recipe.evaluation_counts``) and the counts are summed, so each example is evaluated
  in the batch one process puts it in, and the evaluation is the one a single process gets
  for the same parameters (a recipe without that method: every rank evaluates all of it).
* Rank 0 alone writes files (checkpoints, ``metrics.json``, pictures, pages), reads the
  checkpoint it resumes and hands it to the others, and draws the progress bar; the others do
  not touch ``out_dir``.
* Dropout: rank 0 draws as a one-process run does; rank r > 0 from a generator seeded by
  ``(seed, r)``. Every rank's generator state is saved in the checkpoint, and DDP's gradient
  buckets get the same layout in every run (:func:`_wrap`), so a resumed N-process run ends
  bit for bit where the uninterrupted N-process run ends (checked on CPU with 2 and 3
  processes; the checkpoint must be resumed by N processes). Ctrl-C on any rank stops all of
  them after the same step (the ranks agree on it in the step's all-reduce).

**Tolerance** (N processes vs one, the same global batch, no dropout). The ranks' forward
passes and the gradient all-reduce add in another order, so the runs agree up to float
rounding, as one process on 1 and on 2 threads does. Measured on ``reverse`` (CPU, global
batch 16, lr 3e-3): after 40 steps, 2 processes vs one: losses 1.9e-7 relative, parameters
5.2e-7, the same evaluation (one process, 1 vs 2 threads: 2.1e-7 and 4.8e-7); after 200
steps: 2.3e-5 and 8.7e-6, the same exact match, 0.429 (1 vs 2 threads: 4.2e-5 and 1.8e-5,
0.429). Rounding differences grow with the steps, as between any two runs that round
differently; they stay within those between thread counts. The attention key biases are the
exception: their exact gradient is 0 (softmax ignores a shift shared by all keys), so AdamW
turns rounding noise into steps of up to lr in any two runs (2.6e-4 after 40 steps; 2.5e-4
between the thread counts); they change no output. The stated tolerance, which the tests
hold after 20 steps: losses within 1e-5 relative, parameters (key biases aside) within 1e-5,
the evaluation equal. With dropout the ranks draw other masks than one process does, so the
runs agree in distribution only.
"""

from __future__ import annotations

import difflib
import json
import math
import signal
import sys
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Protocol, TypedDict

import torch
from torch import Tensor, nn

from .._progress import Progress
from .files import run_directory, write_atomic
from .parallel import (
    DEFAULT_TIMEOUT,
    Ranks,
    all_gather,
    all_sum,
    check_batch,
    data_parallel,
    from_rank0,
    lost_peer,
    on_every_rank,
    seed_rank,
    share,
)
from .torch_state import preserve_torch_state

__all__ = [
    "CHECKPOINT",
    "METRICS",
    "SCHEDULES",
    "Recipe",
    "TrainConfig",
    "TrainResult",
    "available_devices",
    "batch_indices",
    "check_device",
    "save_atomic",
    "train",
]

CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.json"
SCHEDULES = ("constant", "rsqrt", "cosine")
FORMAT = 1


@dataclass(frozen=True)
class TrainConfig:
    """How to train (what to train is the :class:`Recipe`).

    Attributes:
        steps: Optimizer steps in all.
        batch_size: Examples a step: the global batch, shared equally by the processes of a
            data-parallel run (which refuses one their number does not divide).
        lr: Peak learning rate (AdamW).
        weight_decay: AdamW's decoupled weight decay.
        warmup_steps: Linear warm-up from 0 to ``lr``.
        schedule: After warm-up: ``"constant"``, ``"rsqrt"`` (``lr * sqrt(warmup / step)``, LRA's)
            or ``"cosine"`` (to 0 at ``steps``).
        grad_clip: Clip the gradient norm to this (None: no clipping).
        seed: Seeds the model's initialisation, the batch order and dropout.
        device: ``"cpu"``, ``"cuda"``, ...; checked here, so a machine without it fails
            before any data is generated (:func:`check_device`).
        checkpoint_every: Steps between checkpoints (and one at the end).
    """

    steps: int = 1000
    batch_size: int = 32
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 0
    schedule: str = "constant"
    grad_clip: float | None = 1.0
    seed: int = 0
    device: str = "cpu"
    checkpoint_every: int = 200

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "checkpoint_every"):
            n = getattr(self, name)
            if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
                raise ValueError(f"{name} must be a positive int, got {n!r}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an int >= 0, got {self.warmup_steps!r}")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a positive number, got {self.lr!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"grad_clip must be > 0 or None, got {self.grad_clip!r}")
        check_device(self.device)

    def lr_factor(self, step: int) -> float:
        """The learning rate of step ``step`` (0-based) over ``lr``."""
        s = step + 1
        if self.warmup_steps and s <= self.warmup_steps:
            return s / self.warmup_steps
        if self.schedule == "rsqrt":
            return math.sqrt(max(self.warmup_steps, 1) / s)
        if self.schedule == "cosine":
            span = max(self.steps - self.warmup_steps, 1)
            return 0.5 * (1 + math.cos(math.pi * min(s - self.warmup_steps, span) / span))
        return 1.0


# Device types a user may mean, for "did you mean" (torch.device's own list is much longer).
_DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")


def available_devices() -> list[str]:
    """The devices this machine and this torch build can train on, e.g.
    ``["cpu", "cuda", "cuda:0"]``."""
    found = ["cpu"]
    for kind in ("cuda", "xpu"):
        module = getattr(torch, kind, None)
        if module is not None and module.is_available():
            found += [kind] + [f"{kind}:{i}" for i in range(module.device_count())]
    if torch.backends.mps.is_available():
        found.append("mps")
    return found


def check_device(name: str) -> torch.device:
    """``torch.device(name)``, once it is known that this machine has it.

    Raises:
        ValueError: ``name`` is not a device string (a typo such as ``"cdua"``), or this
            machine or torch build has no such device; the message lists the ones it has.
    """
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        near = difflib.get_close_matches(str(name).lower(), _DEVICE_TYPES, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ValueError(
            f"device {name!r} is not a torch device{hint}; this machine has: "
            f"{', '.join(available_devices())}"
        ) from None
    if device.type != "cpu" and str(device) not in available_devices():
        raise ValueError(
            f"device {name!r} is not available on this machine (torch "
            f"{torch.__version__}); it has: {', '.join(available_devices())}; "
            f"pick one of these"
        )
    return device


class Recipe(Protocol):
    """What a task gives the trainer.

    Two methods are optional (not part of the protocol: a data-parallel run uses them when
    the recipe has them):

    * ``loss_count(batch: dict[str, Tensor]) -> int``: how many terms the loss of ``batch``
      averages over (tokens, for a loss over tokens). A data-parallel run weights each rank's
      loss and metrics by it, so that they are means over the global batch; without it, by
      the rank's examples.
    * ``evaluation_counts(model, device, rank: int, size: int) -> dict[str, float]``: rank
      ``rank`` of ``size``'s share of the test set, as sums (correct predictions per metric)
      and ``test_examples``; :meth:`evaluate` is each sum over the test set divided by its
      examples. A data-parallel run sums the ranks' counts; without this method every rank
      evaluates the whole test set.
    """

    name: str

    def describe(self) -> dict:
        """Everything that defines the task and model (saved, and checked on resume)."""

    def build_model(self) -> nn.Module:
        """A fresh model (built under the run's seed)."""

    def train_size(self) -> int:
        """Training examples."""

    def batch(self, indices: Tensor, device: torch.device) -> dict[str, Tensor]:
        """The training batch of these example indices, on ``device``."""

    def loss(
        self, model: nn.Module, batch: dict[str, Tensor]
    ) -> tuple[Tensor, dict[str, Tensor | float], int]:
        """``(loss, metrics such as {"acc": ...} (numbers or 0-d tensors), tokens in the
        batch)``."""

    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        """Test metrics of the trained model (called in eval mode, under no_grad)."""

    def pictures(self, model: nn.Module, out_dir: Path, device: torch.device) -> list[str]:
        """Save pictures (e.g. attention maps of a test example); returns their paths."""


@dataclass
class TrainResult:
    """What a run ended with."""

    step: int
    final_loss: float | None
    history: list[dict] = field(default_factory=list)
    evaluation: dict[str, float] = field(default_factory=dict)
    pictures: list[str] = field(default_factory=list)
    interrupted: bool = False
    checkpoint: str = ""


def batch_indices(n: int, batch_size: int, seed: int, step: int) -> Tensor:
    """The examples of step ``step``: a slice of the epoch's permutation, drawn from the seed
    and the epoch only (so a resumed run sees the same batches).
    Shape: ``(min(batch_size, n),)``."""
    per_epoch = max(n // batch_size, 1)
    epoch, i = divmod(step, per_epoch)
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g)[i * batch_size : (i + 1) * batch_size]


def save_atomic(obj, path: Path) -> None:
    """``torch.save`` to a temporary file beside ``path``, then rename over it (the file gets
    the umask's permissions, like any other)."""
    write_atomic(path, lambda f: torch.save(obj, f))


def _write_json_atomic(data: dict, path: Path) -> None:
    write_atomic(path, lambda f: f.write(json.dumps(data, indent=2).encode()))


class _StopFlag:
    """SIGINT sets a flag the loop checks after each step; a second SIGINT interrupts at once."""

    def __init__(self) -> None:
        self.set = False
        self._old: Callable[[int, FrameType | None], Any] | int | None = None

    def __enter__(self) -> _StopFlag:
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)

    def _handle(self, signum, frame) -> None:
        if self.set:
            raise KeyboardInterrupt
        self.set = True


def train(
    recipe: Recipe,
    config: TrainConfig,
    out_dir: str | Path,
    *,
    resume: bool = False,
    progress: bool = True,
    on_step: Callable[[int], None] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> TrainResult:
    """Train ``recipe``'s model under ``config``, writing checkpoints and metrics to ``out_dir``.

    Torch's global settings (threads, default dtype, grad mode, the random number generators
    that seed the model and dropout) are as they were when this returns. Under torchrun every
    process calls it alike (see the module's docstring): the run is data-parallel, and the
    process group it makes is gone again when it returns.

    Args:
        recipe: The task and model.
        config: Steps, (global) batch size, optimizer, seed, device, checkpointing.
        out_dir: Created if missing (and removed again if the run fails before writing in
            it). Holds ``checkpoint.pt``, ``metrics.json`` and pictures. Rank 0's only.
        resume: Continue from ``out_dir``'s checkpoint (which must come from the same recipe,
            config and number of processes). Without it, an existing checkpoint is refused
            rather than overwritten.
        progress: Show the progress bar on stderr (rank 0's).
        on_step: Called with the number of steps done after each step (tests use it).
        timeout: Seconds a process of a data-parallel run waits for the others (to start,
            and at each collective) before it gives up with :class:`ConnectionError`.

    Returns:
        A :class:`TrainResult`; ``interrupted`` when Ctrl-C stopped the run (its checkpoint
        is written; call again with ``resume=True``). On ranks other than 0: the same steps,
        history and evaluation, no pictures.

    Raises:
        ValueError: ``out_dir`` cannot be written to, or its checkpoint is unreadable or is
            another run's; a batch size the processes cannot share equally.
        FileExistsError: A checkpoint exists and ``resume`` is False.
        FileNotFoundError: ``resume`` is True and there is no checkpoint.
        ConnectionError: Another process of a data-parallel run died or did not answer
            within ``timeout``.
    """
    with (
        preserve_torch_state(),
        data_parallel(check_device(config.device), timeout) as (ranks, device),
    ):
        try:
            check_batch(config.batch_size, ranks.size)
        except ValueError as e:
            raise on_every_rank(e) from None
        with _output(out_dir, ranks) as out:
            run = _start(recipe, config, out / CHECKPOINT, resume, ranks, device)
            try:
                interrupted = _loop(run, recipe, config, progress and ranks.main, on_step)
                result = TrainResult(
                    step=run.step,
                    history=run.history,
                    interrupted=interrupted,
                    checkpoint=str(run.path),
                    final_loss=run.history[-1]["loss"] if run.history else None,
                )
                if not interrupted:
                    _finish(run, recipe, result, out)
                return result
            finally:
                run.net = None  # DDP holds the process group: let it go with the group


def _output(out_dir: str | Path, ranks: Ranks):
    """Rank 0 makes (and checks) the output folder; the other ranks never touch it."""
    return run_directory(out_dir) if ranks.main else nullcontext(Path(out_dir))


@dataclass
class _Run:
    """A run in progress: the model, its optimizer and where it stands."""

    model: nn.Module
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    device: torch.device
    ident: dict
    path: Path
    ranks: Ranks = field(default_factory=Ranks)
    net: nn.Module | None = None  # what the loss calls: the model, or DDP around it
    step: int = 0
    saved: int = 0  # the step of the last checkpoint
    history: list[dict] = field(default_factory=list)

    def save(self) -> None:
        """A checkpoint of every rank's state, written by rank 0 (a collective: all ranks
        call it at the same step)."""
        states = _rng_states(self.ranks, self.device)
        if self.ranks.main:
            save_atomic(
                dict(
                    self.ident,
                    step=self.step,
                    history=self.history,
                    model=self.model.state_dict(),
                    optimizer=self.opt.state_dict(),
                    scheduler=self.sched.state_dict(),
                    rng=states[0]["cpu"],
                    rank_rng=states,
                ),
                self.path,
            )
        self.saved = self.step


def _start(
    recipe: Recipe,
    config: TrainConfig,
    ckpt_path: Path,
    resume: bool,
    ranks: Ranks,
    device: torch.device,
) -> _Run:
    """The model built under the seed, its optimizer, and the checkpoint's state if resuming
    (rank 0 reads it and hands it to the others)."""
    ident = dict(
        format=FORMAT, recipe=recipe.describe(), config=asdict(config), world_size=ranks.size
    )
    ck = from_rank0(lambda: _checkpoint_to_resume(ckpt_path, resume, ident), ranks, device)
    if ranks.size > recipe.train_size():
        raise on_every_rank(
            ValueError(
                f"{ranks.size} processes need at least as many training examples; the task has "
                f"{recipe.train_size()}"
            )
        )
    torch.manual_seed(config.seed)
    model = recipe.build_model().to(device)
    seed_rank(config.seed, ranks)
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, config.lr_factor)
    run = _Run(model, opt, sched, device, ident, ckpt_path, ranks)
    if ck is not None:
        run.step, run.history = _restore(run, ck)
        run.saved = run.step
    run.net = _wrap(model, ranks, device)
    return run


def _wrap(model: nn.Module, ranks: Ranks, device: torch.device) -> nn.Module:
    """DistributedDataParallel around the model when there are several ranks: it averages
    the gradients over them during the backward pass.

    DDP lays its gradient buckets out again after the first backward pass of each process, in
    the order the gradients became ready; with 3 or more ranks the bits of an all-reduce
    depend on where a gradient sits in its bucket, so the first step after ``--resume`` would
    add in another order than the uninterrupted run. Asking for the rebuild up front (every
    parameter, in order: what DDP's own ``Join`` does) gives every run the same layout from
    its first step, and bit-identical resumes on any number of ranks.
    """
    if not ranks.distributed:
        return model
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    ddp.reducer._push_all_rebuilt_params()
    return ddp


def _loop(
    run: _Run,
    recipe: Recipe,
    config: TrainConfig,
    progress: bool,
    on_step: Callable[[int], None] | None,
) -> bool:
    """Train to ``config.steps``, checkpointing; True when Ctrl-C stopped it."""
    net = run.net
    assert net is not None, "_start wraps the model before the loop"
    net.train()
    n = recipe.train_size()
    bar = Progress(config.steps, start=run.step, desc=recipe.name) if progress else None
    with _StopFlag() as stop, bar if bar is not None else nullcontext():
        t0, tokens = time.perf_counter(), 0
        while run.step < config.steps:
            ntok, agreed = _collective(
                run, f"step {run.step + 1}", lambda: _step(run, net, recipe, config, n, stop)
            )
            tokens += ntok
            if bar is not None:
                rate = tokens / max(time.perf_counter() - t0, 1e-9)
                shown = {k: v for k, v in run.history[-1].items() if k not in ("step", "lr")}
                bar.update(run.step, **shown, **{"tok/s": f"{rate:,.0f}"})
            if on_step is not None:
                on_step(run.step)
            # Alone, a Ctrl-C counts until now; with several ranks, what they agreed on in the
            # step's all-reduce, so that all stop after the same step.
            stopping = agreed if run.ranks.distributed else stop.set
            if run.step % config.checkpoint_every == 0 or run.step == config.steps or stopping:
                _collective(run, f"checkpoint of step {run.step}", run.save)
            if stopping:
                return True
    return False


def _collective(run: _Run, where: str, work: Callable[[], Any]) -> Any:
    """``work()``; a collective inside it that fails because another rank died or hung
    becomes a :class:`ConnectionError` that says so."""
    try:
        return work()
    except RuntimeError as e:
        lost = lost_peer(e, run.ranks, where)
        if lost is None:
            raise
        resume = (
            f"; the checkpoint of step {run.saved} continues the run with resume=True (--resume)"
            if run.saved
            else ""
        )
        raise ConnectionError(f"{lost}{resume}") from e


def _step(
    run: _Run, net: nn.Module, recipe: Recipe, config: TrainConfig, n: int, stop: _StopFlag
) -> tuple[int, bool]:
    """One optimizer step; appends to the history. Returns the global batch's tokens and
    whether any rank was asked to stop (Ctrl-C) before its all-reduce."""
    indices = share(batch_indices(n, config.batch_size, config.seed, run.step), run.ranks)
    batch = recipe.batch(indices, run.device)
    loss, metrics, ntok = recipe.loss(net, batch)
    logged = {"loss": loss, **metrics}
    agreed = False
    if run.ranks.distributed:
        # Sums over the ranks: the loss's terms, tokens, stop requests, and each mean times
        # this rank's terms (so that their sums over the terms are the global batch's means).
        count = _loss_count(recipe, batch, len(indices))
        total, ntok_sum, asked, *sums = all_sum(
            [count, ntok, float(stop.set), *(_number(v) * count for v in logged.values())],
            run.ranks,
            run.device,
        )
        logged = {k: s / total for k, s in zip(logged, sums)}
        loss = loss * (count * run.ranks.size / total)  # DDP averages: sum_r (...) / N
        ntok = int(ntok_sum)  # a sum of token counts, exact in float64
        agreed = asked > 0
    run.opt.zero_grad(set_to_none=True)
    loss.backward()
    if config.grad_clip is not None:
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), config.grad_clip)
    run.opt.step()
    run.sched.step()
    run.step += 1
    logged = {k: _number(v) for k, v in logged.items()}
    run.history.append(
        dict(step=run.step, loss=logged.pop("loss"), lr=run.opt.param_groups[0]["lr"], **logged)
    )
    return ntok, agreed


def _loss_count(recipe: Recipe, batch: dict[str, Tensor], examples: int) -> int:
    """The terms the recipe's loss averages over (its ``loss_count``), else the examples."""
    count = getattr(recipe, "loss_count", None)
    return int(count(batch)) if count is not None else examples


def _finish(run: _Run, recipe: Recipe, result: TrainResult, out: Path) -> None:
    """Evaluate, then rank 0 writes ``metrics.json`` and draws the pictures. The results are
    written first: a picture that cannot be drawn (matplotlib missing) must not lose them."""
    run.model.eval()
    with torch.no_grad():
        result.evaluation = _collective(run, "evaluation", lambda: _evaluate(run, recipe))
    if not run.ranks.main:
        return
    _write_metrics(run, result, out)
    with torch.no_grad():
        result.pictures = _pictures(recipe, run.model, out, run.device)
    if result.pictures:
        _write_metrics(run, result, out)


def _evaluate(run: _Run, recipe: Recipe) -> dict[str, float]:
    """The recipe's evaluation. With several ranks, each evaluates its share of the test
    batches and their counts are summed (``Recipe.evaluation_counts``), or, for a recipe
    without it, each evaluates the whole test set."""
    counts = getattr(recipe, "evaluation_counts", None)
    if not run.ranks.distributed or counts is None:
        return recipe.evaluate(run.model, run.device)
    mine = counts(run.model, run.device, run.ranks.rank, run.ranks.size)
    names = sorted(mine)  # the same order on every rank
    sums = dict(zip(names, all_sum([mine[k] for k in names], run.ranks, run.device)))
    n = sums.pop("test_examples")
    return {**{k: v / n for k, v in sums.items()}, "test_examples": int(n)}


def _write_metrics(run: _Run, result: TrainResult, out: Path) -> None:
    _write_json_atomic(
        dict(
            run.ident,
            step=run.step,
            final_loss=result.final_loss,
            evaluation=result.evaluation,
            pictures=result.pictures,
            history=run.history,
        ),
        out / METRICS,
    )


def _pictures(recipe: Recipe, model: nn.Module, out: Path, device: torch.device) -> list[str]:
    """The recipe's pictures; none, and one warning line on stderr, when an optional library
    they need (matplotlib) is missing."""
    try:
        return recipe.pictures(model, out, device)
    except ImportError as e:
        print(
            f"{recipe.name}: warning: no pictures ({e}); the results are in {out / METRICS}",
            file=sys.stderr,
        )
        return []


def _checkpoint_to_resume(path: Path, resume: bool, ident: dict) -> dict | None:
    """The checkpoint to continue (None for a new run), after checking it is this run's."""
    if path.exists() and not resume:
        raise FileExistsError(
            f"{path} exists ({_what_is(path)}); pass resume=True "
            f"(--resume) to continue it, or choose another output directory"
        )
    if not resume:
        return None
    if not path.exists():
        raise FileNotFoundError(f"nothing to resume: {path} does not exist")
    ck = _read_checkpoint(path)
    for key in ("format", "recipe", "config"):
        if ck.get(key) != ident[key]:
            raise ValueError(
                f"{path} was written by a different run ({key} differs: "
                f"{ck.get(key)!r} vs {ident[key]!r}); resume with the same "
                f"task, options and config, or choose another output directory"
            )
    if ck.get("world_size", 1) != ident["world_size"]:
        raise ValueError(
            f"{path} was written by a run of {ck.get('world_size', 1)} "
            f"process(es), this one has {ident['world_size']}; resume it with "
            f"--nproc {ck.get('world_size', 1)} (each process's dropout draws "
            f"and share of the batch depend on their number)"
        )
    return ck


def _restore(run: _Run, ck: dict) -> tuple[int, list[dict]]:
    """Put a checkpoint's state into the run: the model, optimizer, schedule, and this rank's
    random number generators."""
    run.model.load_state_dict(ck["model"])
    run.opt.load_state_dict(ck["optimizer"])
    run.sched.load_state_dict(ck["scheduler"])
    if "rank_rng" in ck:
        _set_rng_state(ck["rank_rng"][run.ranks.rank], run.device)
    else:  # written before checkpoints held every rank's generators
        torch.set_rng_state(ck["rng"])
    return ck["step"], ck["history"]


class _RngState(TypedDict):
    """One rank's generators in a checkpoint: the CPU's, and the GPU's when it ran on one."""

    cpu: Tensor
    cuda: Tensor | None


def _rng_states(ranks: Ranks, device: torch.device) -> list[_RngState]:
    """Every rank's generators that dropout on ``device`` draws from (a collective)."""
    cpu = all_gather(torch.get_rng_state(), ranks, device)
    if device.type != "cuda":
        return [_RngState(cpu=c, cuda=None) for c in cpu]
    cuda = all_gather(torch.cuda.get_rng_state(device), ranks, device)
    return [_RngState(cpu=c, cuda=g) for c, g in zip(cpu, cuda)]


def _set_rng_state(state: _RngState, device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    cuda = state.get("cuda")
    if cuda is not None and device.type == "cuda":
        torch.cuda.set_rng_state(cuda, device)


_CHECKPOINT_KEYS = (
    "format",
    "recipe",
    "config",
    "step",
    "history",
    "model",
    "optimizer",
    "scheduler",
    "rng",
)


def _read_checkpoint(path: Path) -> dict:
    """The checkpoint at ``path``; ValueError when it is empty, truncated or not one of ours
    (a crash of the machine mid-write, a copy cut short, another program's file)."""
    try:
        ck = torch.load(path, map_location="cpu", weights_only=False)
        why = "" if isinstance(ck, dict) else f"it holds a {type(ck).__name__}, not a dict"
    except Exception as e:
        first = " ".join(str(e).split()).split(". ")[0]  # torch adds paragraphs of advice
        why = f"{type(e).__name__}: {first}" if first else type(e).__name__
    if not why and not set(_CHECKPOINT_KEYS) <= ck.keys():
        why = f"it lacks {sorted(set(_CHECKPOINT_KEYS) - ck.keys())}"
    if why:
        size = path.stat().st_size
        raise ValueError(
            f"{path} ({size} bytes) is not a readable qkv checkpoint ({why}); "
            f"move it away (or delete it) to start the run again, or choose "
            f"another output directory"
        )
    return ck


def _number(v) -> float:
    return float(v.detach()) if isinstance(v, Tensor) else float(v)


def _what_is(path: Path) -> str:
    """What an existing checkpoint holds, for the message that refuses to overwrite it."""
    try:
        return f"a run of {_read_checkpoint(path)['step']} steps"
    except ValueError:
        return "not a readable checkpoint: move it away to start again"
