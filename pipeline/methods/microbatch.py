"""Training and evaluation whose numbers do not depend on the thread count (``run.deterministic``).

Why: a CPU op split across N threads reduces in an order that depends on N (a weight gradient's sum
over the batch, a batch norm's mean), so one step at 1 and at 2 threads differs in the last bits, and
``run.threads: auto`` changes N with the machine's load: the same recipe trained to other weights
beside a busy process. Here each batch is cut into micro-batches of a fixed size (``train.micro_batch``),
each computed start to end on one thread (torch's intra-op pool at one thread), and their gradients
are summed in micro-batch order. The thread count only decides how many micro-batches run at once,
never what any of them computes, so the adaptive thread controller may change it freely.

What the cut changes in the model's arithmetic, and how it stays a pure function of the batch:

- **batch norm** layers in training normalise with their micro-batch's statistics (ghost batch
  norm); their running statistics are updated once per step, from the size-weighted mean of the
  micro-batches' means and variances, added in a fixed order on the calling thread. Each micro-batch's
  mean and variance are the ones the norm's own kernel computes while normalising (written into
  buffers of that micro-batch's own, :class:`_MicroBatchBuffers`), not computed a second time: a
  separate channel-wise ``var_mean`` cost more than the norm itself on one thread.
- **dropout** (and torchvision's stochastic depth) draws its masks from a generator seeded by the
  step (one draw from torch's global generator, so a resumed run continues the sequence) and the
  micro-batch's index, not from the global generator that the threads would race for.
- A model that draws from torch's global generator in some other way is caught on the first step,
  which always runs its micro-batches one after another on the calling thread: if the generator's
  state moved, every later step does the same (the same numbers, at one thread's speed).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from ..lazy import lazy_module

if TYPE_CHECKING:
    import torch
    from torch import nn
else:
    torch = lazy_module("torch")
    nn = lazy_module("torch.nn")


def register_module_forward_hook(hook: Callable[..., Any]) -> Any:
    return nn.modules.module.register_module_forward_hook(hook)

DEFAULT_MICRO_BATCH = 16

_here = threading.local()  # which micro-batch the calling thread computes, read by the layer hooks


def micro_slices(n: int, micro: int) -> list[slice]:
    """``n`` samples cut into consecutive micro-batches of ``micro`` (the last one shorter)."""
    return [slice(start, min(start + micro, n)) for start in range(0, n, micro)]


def groups(count: int, workers: int) -> list[range]:
    """``count`` micro-batches dealt to at most ``workers`` threads, in consecutive runs."""
    workers = max(1, min(workers, count))
    size, extra = divmod(count, workers)
    out, start = [], 0
    for w in range(workers):
        stop = start + size + (1 if w < extra else 0)
        out.append(range(start, stop))
        start = stop
    return out


_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_lock = threading.Lock()


def _executor(workers: int) -> ThreadPoolExecutor:
    """The process's micro-batch threads (one pool, grown on demand: training loops come and go)."""
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size < workers:
            if _pool is not None:
                _pool.shutdown(wait=True)
            _pool, _pool_size = ThreadPoolExecutor(workers, thread_name_prefix="micro-batch"), workers
        return _pool


def _dropout_types() -> tuple[type, ...]:
    types: list[type] = [nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d]
    try:
        from torchvision.ops import StochasticDepth
        types.append(StochasticDepth)
    except ImportError:  # torchvision is optional for a plain torch model
        pass
    return tuple(types)


def _mask_shape(module: nn.Module, out: torch.Tensor) -> tuple[int, ...]:
    """The shape of the keep mask ``module`` draws for ``out`` (broadcast over what it keeps whole)."""
    if isinstance(module, nn.Dropout):
        return tuple(out.shape)
    if isinstance(module, (nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)):
        return (*out.shape[:2], *[1] * (out.dim() - 2))  # whole channels
    if getattr(module, "mode", "row") == "row":  # stochastic depth: whole samples ...
        return (out.shape[0], *[1] * (out.dim() - 1))
    return tuple([1] * out.dim())  # ... or the whole batch


class _MicroBatchBuffers(dict):  # type: ignore[type-arg]
    """One micro-batch's running-statistics buffers of one batch norm: the norm's kernel, at a factor
    of 1, leaves the micro-batch's mean and (unbiased) variance in them."""

    def __init__(self, like: torch.Tensor) -> None:
        super().__init__(running_mean=torch.zeros_like(like), running_var=torch.ones_like(like),
                         num_batches_tracked=torch.zeros((), dtype=torch.long))


class _StepBuffers(dict):  # type: ignore[type-arg]
    """A batch norm's buffers during a step: on a micro-batch's thread, that micro-batch's own
    (:class:`_MicroBatchBuffers`); elsewhere none (a norm with no running buffers updates nothing).

    Installed as the norm's ``_buffers``, which ``nn.Module.__getattr__`` reads the running
    statistics from; :attr:`real` is put back when the step ends.
    """

    def __init__(self, real: dict[str, Any], scratch: list[_MicroBatchBuffers]) -> None:
        super().__init__(real)
        self.real, self.scratch = real, scratch

    def __getitem__(self, name: str) -> Any:
        index = getattr(_here, "index", None)
        if name in _MICRO_BATCH_BUFFERS:
            return None if index is None else self.scratch[index][name]
        return self.real[name]


_MICRO_BATCH_BUFFERS = frozenset({"running_mean", "running_var", "num_batches_tracked"})


def _fits(view: _StepBuffers, like: torch.Tensor) -> bool:
    """Whether a norm's kept micro-batch buffers still match its statistics (not moved or converted)."""
    if not view.scratch:
        return True
    mine = view.scratch[0]["running_mean"]
    return bool(mine.shape == like.shape and mine.dtype == like.dtype and mine.device == like.device)


class MicroBatches:
    """One model's steps in micro-batches on a pool of threads (see the module's docstring).

    ``gradients`` computes a training step's gradients into the parameters' ``.grad``; ``forward``
    an evaluation pass. ``workers`` (how many micro-batches run at once) may change between steps
    (:meth:`set_workers`): the results do not. Use as a context manager: it holds torch at one
    intra-op thread and keeps hooks on the model's batch norm and dropout layers until closed.
    """

    def __init__(self, model: nn.Module, micro: int, workers: int,
                 log: Callable[[str], None] | None = None) -> None:
        if micro < 1:
            raise ValueError(f"micro-batch size must be >= 1, got {micro}")
        self.model, self.micro, self.log = model, micro, log
        self.workers = max(1, workers)
        self.sequential: bool | None = None  # unknown until the first training step
        # Any: torch types a module's attributes as Tensor | Module, these are floats and buffers
        # Batch norms with the stock forward (a subclass with its own, like MobileTL's shift-only
        # norm that never updates its statistics, is left as it is).
        stock = nn.modules.batchnorm._BatchNorm.forward
        self._norms: list[Any] = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
                                  and type(m).forward is stock]
        drop_types = _dropout_types()
        self._drops: list[Any] = [m for m in model.modules() if isinstance(m, drop_types)]
        self._views: dict[int, _StepBuffers] = {}  # id(norm) -> its buffers during a step
        self._dropping: dict[int, float] = {}  # id -> the drop probability this step applies itself
        self._hooks: list[Any] = []
        self._threads_before: int | None = None

    # -- lifetime
    def __enter__(self) -> MicroBatches:
        # Global hooks, not hooks on the layers: a model copied while they are on (a frozen bottom
        # folded at its first forward) must not carry them. They act only on this model's layers,
        # during a step (the two tables below are empty otherwise).
        self._hooks = [register_module_forward_hook(self._apply_mask)] if self._drops else []
        self._threads_before = torch.get_num_threads()
        torch.set_num_threads(1)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None

    def set_workers(self, workers: int) -> None:
        self.workers = max(1, int(workers))

    # -- running micro-batches
    def _run(self, count: int, work: Callable[[int], Any], *, sequential: bool = False) -> list[Any]:
        """``work(i)`` for every micro-batch index, results in index order."""
        if sequential or self.workers == 1 or count == 1:
            return [work(i) for i in range(count)]
        parts = groups(count, self.workers)

        def run_group(indices: range) -> list[Any]:
            return [work(i) for i in indices]

        out: list[Any] = []
        for results in _executor(len(parts)).map(run_group, parts):
            out.extend(results)
        return out

    def gradients(self, x: torch.Tensor, y: torch.Tensor, params: Sequence[nn.Parameter],
                  step: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                  context: Callable[[], Any]) -> tuple[float, torch.Tensor]:
        """One training step's gradients, into each parameter's ``.grad`` (None where unused).

        ``step(x_i, y_i)`` returns the micro-batch's mean loss and its outputs; it runs inside
        ``context()`` (autocast) with gradients on. Returns the batch's mean loss and the outputs.
        """
        n = len(y)
        slices = micro_slices(n, self.micro)
        seed = int(torch.randint(0, 2**62, ()).item()) if self._drops else 0
        active = [m for m in self._norms if m.training and m.track_running_stats
                  and m.running_mean is not None]
        kept = self._take_running(active, len(slices))
        self._dropping = {id(m): float(m.p) for m in self._drops if m.training and m.p > 0}
        for m in self._drops:
            if id(m) in self._dropping:
                m.p = 0.0  # the hook applies the drop, from its own generator

        def work(i: int) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor | None, ...]]:
            s = slices[i]
            _here.index = i
            _here.generator = torch.Generator().manual_seed(seed + i) if self._dropping else None
            try:
                with torch.enable_grad(), context():
                    loss, out = step(x[s], y[s])
                weighted = loss.float() * ((s.stop - s.start) / n)
                grads = torch.autograd.grad(weighted, list(params), allow_unused=True)
            finally:
                _here.index, _here.generator = None, None
            return weighted.detach(), out.detach(), grads

        ok = False
        try:
            if self.sequential is None:
                before = torch.random.get_rng_state()
                results = self._run(len(slices), work, sequential=True)
                self.sequential = not torch.equal(before, torch.random.get_rng_state())
                if self.sequential and self.log is not None:
                    self.log("run.deterministic: the model draws random numbers from torch's global "
                             "generator (a layer other than dropout or stochastic depth), so its "
                             "micro-batches run one after another on one thread")
            else:
                results = self._run(len(slices), work, sequential=self.sequential)
            ok = True
        finally:
            for m in self._drops:
                if id(m) in self._dropping:
                    m.p = self._dropping[id(m)]
            self._dropping = {}
            self._give_back_running(active, kept, slices, n, update=ok)
        for j, p in enumerate(params):
            total = None
            for _, _, grads in results:  # in micro-batch order: the sum's rounding is fixed
                g = grads[j]
                if g is not None:
                    total = g if total is None else total + g
            p.grad = total
        loss = results[0][0]
        for weighted, _, _ in results[1:]:
            loss = loss + weighted
        return float(loss), torch.cat([out for _, out, _ in results])

    def forward(self, x: torch.Tensor, context: Callable[[], Any],
                fn: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """``fn(x)`` (default: the model) without gradients, micro-batch by micro-batch, concatenated."""
        fn = fn or self.model
        slices = micro_slices(len(x), self.micro)

        def work(i: int) -> torch.Tensor:
            with torch.no_grad(), context():
                return fn(x[slices[i]])

        return torch.cat(self._run(len(slices), work))

    # -- batch norm: statistics per micro-batch, running averages once per step
    def _take_running(self, active: list[Any], count: int) -> list[tuple[Any, Any, Any, Any]]:
        kept = []
        means, variances, counts = [], [], []
        for m in active:
            kept.append((m.running_mean, m.running_var, m.num_batches_tracked, m.momentum))
            # Each micro-batch's norm writes its statistics into buffers of its own (threads never
            # write to one tensor), with a factor of exactly 1: momentum None turns the factor into
            # 1 / num_batches_tracked, and those buffers count from 0. The views and buffers are kept
            # from step to step (set back to zeros, ones and 0 below): per step, a few calls over all.
            view = self._views.get(id(m))
            if view is None or view.real is not m._buffers or not _fits(view, m.running_mean):
                view = self._views[id(m)] = _StepBuffers(m._buffers, [])
            while len(view.scratch) < count:
                view.scratch.append(_MicroBatchBuffers(m.running_mean))
            for buffers in view.scratch[:count]:
                means.append(buffers["running_mean"])
                variances.append(buffers["running_var"])
                counts.append(buffers["num_batches_tracked"])
            m.__dict__["_buffers"] = view
            m.momentum = None
        if means:
            with torch.no_grad():
                torch._foreach_zero_(means + variances + counts)
                torch._foreach_add_(variances, 1.0)
        return kept

    def _give_back_running(self, active: list[Any], kept: list[tuple[Any, Any, Any, Any]],
                           slices: list[slice], n: int, *, update: bool) -> None:
        for m, (_mean, _var, _tracked, momentum) in zip(active, kept, strict=True):
            m.__dict__["_buffers"] = m._buffers.real
            m.momentum = momentum
        if not update or not active:
            return
        # The size-weighted sum over micro-batches, in their order, for every norm at once (the same
        # operations, element by element, as one norm at a time).
        views = [self._views[id(m)] for m in active]
        with torch.no_grad():
            batch_mean: list[Any] = []
            batch_var: list[Any] = []
            for i, s in enumerate(slices):
                w = (s.stop - s.start) / n
                mi = torch._foreach_mul([v.scratch[i]["running_mean"] for v in views], w)
                vi = torch._foreach_mul([v.scratch[i]["running_var"] for v in views], w)
                if i == 0:
                    batch_mean, batch_var = list(mi), list(vi)
                else:
                    torch._foreach_add_(batch_mean, mi)
                    torch._foreach_add_(batch_var, vi)
            tracked = [t for _, _, t, _ in kept if t is not None]
            if tracked:
                torch._foreach_add_(tracked, 1)
            factors: dict[float, list[int]] = {}
            for j, (_, _, t, momentum) in enumerate(kept):
                f = momentum if momentum is not None else 1.0 / float(t)
                factors.setdefault(f, []).append(j)
            for f, js in factors.items():
                for stats, index in ((batch_mean, 0), (batch_var, 1)):
                    running = [kept[j][index] for j in js]
                    update_by = [stats[j].to(r.dtype) for j, r in zip(js, running, strict=True)]
                    torch._foreach_mul_(running, 1 - f)
                    torch._foreach_add_(running, update_by, alpha=f)

    # -- dropout: masks from the micro-batch's own generator
    def _apply_mask(self, module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor | None:
        p = self._dropping.get(id(module))
        if p is None:
            return None
        generator = getattr(_here, "generator", None)
        if generator is None:
            return None
        if p >= 1.0:
            return out * 0
        keep = torch.empty(_mask_shape(module, out), dtype=out.dtype).bernoulli_(1 - p, generator=generator)
        return out * keep / (1 - p)
