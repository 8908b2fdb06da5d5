"""The training loop behind ``qkv train``: seeded, checkpointed, resumable to the bit, on one
process or data-parallel on several (torchrun).

What a task supplies is a :class:`Recipe` (build the model, make a batch from example indices,
the loss and its metrics, the evaluation, the pictures); the trainer owns everything else:

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

**Modules.** This module is the loop and :func:`train`; the rest lives by job beside it
(each name importable from here as before): ``config.py`` (:class:`TrainConfig`,
:class:`Recipe`, :class:`TrainResult`, the devices), ``checkpoint.py`` (the run's state,
writing and reading checkpoints, the random number generators), ``stopping.py`` (Ctrl-C, a
lost peer) and ``results.py`` (the evaluation, ``metrics.json``, the pictures). Imports run
one way: trainer -> results -> stopping -> checkpoint, and trainer, results -> config.

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

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path

import torch
from torch import Tensor, nn

from .._progress import Progress
from .checkpoint import (
    CHECKPOINT,
    FORMAT,
    _checkpoint_to_resume,
    _restore,
    _Run,
    save_atomic,
)
from .config import (
    SCHEDULES,
    Recipe,
    TrainConfig,
    TrainResult,
    available_devices,
    check_device,
)
from .files import run_directory
from .parallel import (
    DEFAULT_TIMEOUT,
    Ranks,
    all_sum,
    check_batch,
    data_parallel,
    from_rank0,
    on_every_rank,
    seed_rank,
    share,
)
from .results import METRICS, _finish
from .stopping import _collective, _StopFlag
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


def batch_indices(n: int, batch_size: int, seed: int, step: int) -> Tensor:
    """The examples of step ``step``: a slice of the epoch's permutation, drawn from the seed
    and the epoch only (so a resumed run sees the same batches).
    Shape: ``(min(batch_size, n),)``."""
    per_epoch = max(n // batch_size, 1)
    epoch, i = divmod(step, per_epoch)
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g)[i * batch_size : (i + 1) * batch_size]


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


def _number(v) -> float:
    return float(v.detach()) if isinstance(v, Tensor) else float(v)
