"""Model updates: a ``finetune`` that starts from an earlier model file, grows its head, replays old samples.

On a device the data keeps arriving: more images of the classes it knows, and images of classes it
has never seen. Retraining from the pretrained backbone every time costs the whole training again;
a *warm start* continues from the last trained model instead (``init:``), and only the samples
that are new need to be learnt. Three pieces, each used by ``pipeline.methods.finetune``:

- **where the model comes from** (:func:`locate_init`): a model file a run wrote
  (``runs/<recipe>/<time>/stages/<stage>/model.pt``) or a prefix of a stored ``finetune`` result's
  fingerprint, whose ``model.pt`` is used. The file enters the stage's fingerprint by its content
  (``Finetune.identity``), never by its path;
- **what it must match** (:func:`plan_init`): the recipe's architecture, cut, input size and
  method, checked before any work, each refusal naming the recipe's value and the file's. Its class
  names are matched to the data's by name: a class the model knows keeps its classifier row
  bit for bit, a new class gets the row a fresh head would have (the seeded classifier the stage
  makes anyway), so the head grows without disturbing what it knew (:func:`warm_start`);
- **replay** (:class:`Replay`): new samples mixed with earlier ones in every batch. The cache is
  the replay buffer: "earlier" samples are those of the classes the init model was trained on (its
  description's class names), "new" ones those of the classes it did not know. ``replay: 0.5``
  fills half of each batch with earlier samples; an epoch is one pass over the new samples, and the
  earlier ones are drawn from the epoch's shuffled order (cycled, reshuffled, when too few);
- **distillation** (:class:`Distillation`, ``distill:``): a loss term that keeps the model's scores on the
  classes it knew close to the init model's own (Learning without Forgetting).

Why by class and not by sample: a trainer sees a stream of features, not the samples' content keys
(those stay with the dataset, several stages upstream); a class is what a model file can say it
was trained on without recording its data. New samples of known classes therefore count as
earlier ones (they are replayed, not favoured); with no new class there is nothing to separate,
and every sample trains as without replay.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import MissingPathError, ModelError, PipelineError
from ..lazy import lazy_module

if TYPE_CHECKING:
    import torch
    from torch import nn

    from stores.catalog import Catalog

    from ..deploy import model_file
    from ..models import zoo
    from ..spec import ModelDesc
else:
    torch = lazy_module("torch")
    nn = lazy_module("torch.nn")
    model_file = lazy_module("pipeline.deploy.model_file")
    zoo = lazy_module("pipeline.models.zoo")

MODEL_FILE = "model.pt"  # pipeline.deploy.model_file.MODEL_FILE, without importing torch to say it
EXPORTED_SUFFIXES = (".pt2", ".onnx", ".ts")
_HEX = re.compile(r"[0-9a-f]{6,64}")


class InitError(PipelineError, ValueError):
    """``init:`` names nothing usable, or a model that does not fit the stage (exit 2, before work)."""


# ------------------------------------------------------------------------------------- locating
@dataclass(frozen=True)
class InitSource:
    """Where an ``init:`` model file is: ``path``; ``entry``: the store entry it is in (a fingerprint
    given as ``init:``), else None."""

    given: str
    path: Path
    entry: str | None = None

    def describe(self) -> str:
        return f"{self.path} (stored result {self.entry[:12]})" if self.entry else str(self.path)


def locate_init(init: str, catalog: Catalog | None) -> InitSource:
    """The model file ``init`` names: a file (or a stage directory holding ``model.pt``), or a prefix of a
    stored ``finetune`` result's fingerprint in ``catalog``."""
    path = Path(init).expanduser()
    if path.is_dir():
        if (path / MODEL_FILE).is_file():
            return InitSource(init, path / MODEL_FILE)
        raise InitError(f"init: {init} is a directory without a {MODEL_FILE}; give the model file a run "
                        f"wrote (<run>/stages/<stage>/{MODEL_FILE})")
    if path.suffix in EXPORTED_SUFFIXES:
        raise InitError(f"init: {init} is an exported model ({path.suffix}): its layers cannot be trained "
                        "further, nor its head grown; give the model file it was exported from "
                        f"(<run>/stages/<stage>/{MODEL_FILE})")
    if path.is_file():
        return InitSource(init, path)
    if _HEX.fullmatch(init.strip().lower()) and catalog is not None:
        return _stored(init, catalog)
    raise MissingPathError(
        f"init: {init} does not exist; expected a model file a run wrote "
        f"(runs/<recipe>/<time>/stages/<stage>/{MODEL_FILE}) or the fingerprint (a prefix, 6+ hex digits) of "
        "a stored finetune result (`python -m pipeline cache ls`)")


def _stored(ref: str, catalog: Catalog) -> InitSource:
    from ..data.entry_ref import CacheEntryError, find_entry

    try:
        entry = find_entry(catalog, ref)
    except CacheEntryError as exc:
        raise InitError(f"init: {exc}") from None
    stage_type = str(entry.lineage.get("type", "?"))
    path = Path(entry.path) / MODEL_FILE
    if not path.is_file():
        raise InitError(f"init: {ref} is the stored result {entry.fingerprint[:12]} of a {stage_type} stage, "
                        f"which holds no {MODEL_FILE}; give a finetune result's fingerprint or model file")
    return InitSource(ref, path, entry.fingerprint)


def read_init(source: InitSource) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(state dict, description) of the init model file, checked as any model file is."""
    try:
        return model_file.read_model_file(source.path)
    except model_file.ModelFileError as exc:
        raise InitError(f"init: {exc}") from None


# ------------------------------------------------------------------------------------- checking
@dataclass(frozen=True)
class ClassPlan:
    """How the init model's classes map onto the data's: ``kept`` pairs (data index, init index) of the
    classes both have; ``added``: data indices of classes the model never saw; ``dropped``: init class
    names the data no longer has (their rows are left out)."""

    init_names: tuple[str, ...]
    names: tuple[str, ...]
    kept: tuple[tuple[int, int], ...]
    added: tuple[int, ...]
    dropped: tuple[str, ...] = ()

    @classmethod
    def of(cls, init_names: Sequence[str], names: Sequence[str]) -> ClassPlan:
        where = {name: i for i, name in enumerate(init_names)}
        kept = tuple((i, where[n]) for i, n in enumerate(names) if n in where)
        added = tuple(i for i, n in enumerate(names) if n not in where)
        dropped = tuple(n for n in init_names if n not in set(names))
        return cls(tuple(init_names), tuple(names), kept, added, dropped)

    @property
    def old(self) -> tuple[int, ...]:
        """Data class indices the init model was trained on (its samples are the "earlier" ones)."""
        return tuple(i for i, _ in self.kept)

    @property
    def unchanged(self) -> bool:
        """Same classes in the same order: the init model's head is used as it is."""
        return self.init_names == self.names

    def summary(self) -> dict[str, Any]:
        return {"classes_kept": [self.names[i] for i in self.old],
                "classes_added": [self.names[i] for i in self.added],
                "classes_dropped": list(self.dropped)}


def _desc(arch: str, width: Any, small: Any) -> str:
    return f"{arch} (width_mult {float(width):g}{', small_input' if small else ''})"


def plan_init(description: Mapping[str, Any], source: InitSource, *, model: ModelDesc, model_name: str,
              train_last_blocks: int, top_input_shape: Sequence[int], resolution: int | None,
              method: Mapping[str, Any], class_names: Sequence[str], head: type) -> ClassPlan:
    """Check that the init model fits the stage (architecture, cut, input size, method, a head that can
    grow where classes are new); how its classes map onto the data's. Every refusal names the recipe's
    value and the file's."""
    file = source.describe()
    net = dict(description["network"])
    family = net.get("family")
    if family != "transfer":
        what = {"backbone": "a pretrained backbone (a pretrain result)",
                "neuroflux_exit": "a NeuroFlux exit"}.get(str(family), f"a {family!r} network")
        raise InitError(f"init: {file} is {what}, not a finetune result; give a finetune stage's model file "
                        "(a backbone goes in `model:`, e.g. {type: backbone, weights: PATH})")
    theirs = _desc(str(net.get("arch")), net.get("width_mult", 1.0), net.get("small_input", False))
    ours = _desc(model.arch, model.width_mult, model.small_input)
    if theirs != ours:
        raise InitError(f"init: {file} is a {theirs} model; this stage's `model: {model_name}` is a "
                        f"{ours}: a warm start needs the same architecture (use a model trained from this "
                        "backbone, or remove init: to train from the backbone)")
    if "resolution" in net and int(net["resolution"]) != model.resolution:
        raise InitError(f"init: {file} was built for {net['resolution']}px inputs; `model: {model_name}` for "
                        f"{model.resolution}px")
    cut = int(net.get("train_last_blocks", -1))
    if cut != train_last_blocks:
        raise InitError(f"init: {file} was trained at cut train_last_blocks={cut}; this stage trains the "
                        f"last {train_last_blocks} blocks: set the cut to {cut} (the feature stream's "
                        "frozen_forward, or train_last_blocks) or remove init:")
    theirs_in = [int(d) for d in net.get("top_input_shape", [])]
    file_res = int(description["input"]["resolution"])
    if theirs_in != [int(d) for d in top_input_shape] or (resolution is not None and resolution != file_res):
        raise InitError(f"init: {file} takes {file_res}px images (features {tuple(theirs_in)} at the cut); "
                        f"this stage's data is {resolution if resolution is not None else '?'}px (features "
                        f"{tuple(int(d) for d in top_input_shape)}): decode at {file_res}px or remove init:")
    if dict(net.get("method", {})) != dict(method):
        raise InitError(f"init: {file} was trained with method {_method_text(net.get('method'))}; this stage "
                        f"trains with {_method_text(method)}, whose layers differ: set the stage's method to "
                        "the model's (a warm start continues the layers it was trained with) or remove init:")
    plan = ClassPlan.of([str(n) for n in description["class_names"]], [str(n) for n in class_names])
    if len(description["class_names"]) != int(net["num_classes"]):
        raise InitError(f"init: {file}: its description names {len(description['class_names'])} classes for "
                        f"a {net['num_classes']}-way head (damaged or hand-edited)")
    if plan.added and not issubclass(head, nn.Linear):
        new = ", ".join(plan.names[i] for i in plan.added)
        raise InitError(f"init: {file}: the data has classes the model does not know ({new}), but the head "
                        f"of {model.arch} ends in a {head.__name__}, which cannot grow here (only a Linear "
                        "classifier does): remove init: to retrain with every class, or keep the model's "
                        f"classes ({', '.join(plan.init_names)})")
    if not plan.kept:
        raise InitError(f"init: {file} knows none of the data's classes (it has "
                        f"{', '.join(plan.init_names)}; the data has {', '.join(plan.names)}): class names "
                        "are matched by name; remove init:")
    return plan


def _method_text(method: Any) -> str:
    if not isinstance(method, Mapping):
        return repr(method)
    extra = ", ".join(f"{k}: {v}" for k, v in method.items() if k != "type")
    return f"{method.get('type')}" + (f" {{{extra}}}" if extra else "")


# ----------------------------------------------------------------------------------- the network
def warm_start(bottom: nn.Module, top: nn.Module, state: Mapping[str, torch.Tensor], plan: ClassPlan,
               source: InitSource, model_name: str) -> dict[str, Any]:
    """Load the init model into ``bottom`` + ``top`` (a fresh, seeded network the stage made, its method
    applied): the bottom must be the one the model was trained on (compared, not loaded); the top takes
    the file's weights; the classifier's rows of known classes are the file's, bit for bit, those of new
    classes stay as the fresh head drew them. Returns what was done, for the result."""
    file = source.describe()
    ours = bottom.state_dict()
    theirs = {k[len("bottom."):]: v for k, v in state.items() if k.startswith("bottom.")}
    differs = sorted(k for k in ours if k not in theirs or theirs[k].shape != ours[k].shape
                     or not torch.equal(theirs[k].to(ours[k].device), ours[k]))
    if differs or set(theirs) - set(ours):
        first = (differs or sorted(set(theirs) - set(ours)))[0]
        raise InitError(f"init: {file} was trained on another frozen bottom than `model: {model_name}`'s "
                        f"(first difference: bottom.{first}): its top would read features it never saw. Keep "
                        "the backbone the model was trained from (e.g. `{type: backbone, weights: ...}` with "
                        "its weights) or remove init:")
    top_state = {k[len("top."):]: v for k, v in state.items() if k.startswith("top.")}
    name, _layer = zoo.final_layer(top)
    fresh = {k: v.detach().clone() for k, v in top.state_dict().items()}
    for part in ("weight", "bias"):
        key = f"{name}.{part}"
        if key not in fresh:
            continue
        if key not in top_state:
            raise InitError(f"init: {file} has no classifier {part} ({key}) where this stage's network "
                            "has one")
        old = top_state[key].to(fresh[key].device, fresh[key].dtype)
        if old.shape[1:] != fresh[key].shape[1:]:
            raise InitError(f"init: {file}'s classifier {part} has shape {tuple(old.shape)}, this stage's "
                            f"{tuple(fresh[key].shape)}: another head")
        grown = fresh[key].clone()
        for new_i, old_i in plan.kept:
            grown[new_i] = old[old_i]
        top_state[key] = grown
    try:
        top.load_state_dict(top_state, strict=True)
    except RuntimeError as exc:
        raise InitError(f"init: {file}'s top does not fit this stage's network: {str(exc).splitlines()[0]}"
                        f"{' ...' if len(str(exc).splitlines()) > 1 else ''}") from None
    return plan.summary()


def keep_columns(model: nn.Module, columns: Sequence[int]) -> nn.Module:
    """``model``'s logits with only ``columns`` in the running (the others at -inf): the init model's own
    prediction, made by the warm-started network before it trains (its rows are the init model's)."""
    return _keep_columns_type()(model, columns)


@functools.cache
def _keep_columns_type() -> type[nn.Module]:
    # Defined on first use: recipes load (and validate) where torch is not installed.
    class KeepColumns(nn.Module):
        def __init__(self, model: nn.Module, columns: Sequence[int]) -> None:
            super().__init__()
            self.model = model
            self.columns = list(columns)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            logits = self.model(x)
            mask = torch.full((logits.shape[-1],), float("-inf"), device=logits.device, dtype=logits.dtype)
            mask[self.columns] = 0
            return logits + mask

    return KeepColumns


def class_tallies(model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], num_classes: int, *,
                  precision: str = "fp32") -> tuple[torch.Tensor, torch.Tensor]:
    """(correct, seen) per class in one pass: the same predictions as ``trainer.evaluate`` makes (eval mode,
    at ``precision``, in micro-batches on a CPU under ``run.deterministic``), so the accuracy of any set of
    classes, all of them included, is what ``evaluate`` would report for those samples."""
    from contextlib import nullcontext

    from ..threads import compute_threads
    from .amp import AmpPolicy, module_device, to_device
    from .microbatch import DEFAULT_MICRO_BATCH, MicroBatches
    from .trainer import thread_invariant

    model.eval()
    device = module_device(model)
    micro = MicroBatches(model, DEFAULT_MICRO_BATCH, compute_threads()) if thread_invariant(device) else None
    amp = AmpPolicy(precision, device)
    correct = torch.zeros(num_classes, dtype=torch.int64, device=device)
    seen = torch.zeros(num_classes, dtype=torch.int64, device=device)
    with micro if micro is not None else nullcontext(), torch.no_grad():
        for x, y in to_device(batches, device):
            if micro is not None:
                logits = micro.forward(x, amp.autocast)
            else:
                with amp.autocast():
                    logits = model(x)
            hit = logits.float().argmax(1) == y
            correct += torch.bincount(y[hit], minlength=num_classes)
            seen += torch.bincount(y, minlength=num_classes)
    return correct.cpu(), seen.cpu()


def accuracy_of(tallies: tuple[torch.Tensor, torch.Tensor], classes: Sequence[int]) -> float | None:
    """Accuracy over the samples of ``classes`` from :func:`class_tallies` (None: no such sample)."""
    correct, seen = tallies
    index = torch.tensor(list(classes), dtype=torch.int64)
    n = int(seen[index].sum()) if len(index) else 0
    return int(correct[index].sum()) / n if n else None


def of_classes(batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
               classes: Sequence[int]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The samples of ``batches`` whose label is one of ``classes`` (batches that keep none are skipped)."""
    wanted = torch.tensor(list(classes), dtype=torch.int64)
    for x, y in batches:
        keep = torch.isin(y, wanted.to(y.device))
        if bool(keep.all()):
            yield x, y
        elif bool(keep.any()):
            yield x[keep], y[keep]


# ------------------------------------------------------------------------------------------ replay
@dataclass(frozen=True)
class Replay:
    """Batches of ``batch_size`` with ``old_per_batch`` earlier samples (of the ``old`` classes) and the
    rest new; one epoch is one pass over the new samples.

    Built from each epoch's shuffled stream, so both the new samples' order and the earlier samples
    drawn change with the epoch, and everything is a function of (the stream, ``seed``, the epoch): a
    resumed run draws what an uninterrupted one drew. Within a batch the two kinds are interleaved by a
    seeded permutation (micro-batches, and their batch-norm statistics, see both kinds).
    """

    fraction: float
    batch_size: int
    old: tuple[int, ...]
    seed: int = 0
    counts: tuple[int, int] = (0, 0)  # (earlier, new) training samples, counted before training

    @property
    def old_per_batch(self) -> int:
        return int(round(self.fraction * self.batch_size))

    @property
    def new_per_batch(self) -> int:
        return self.batch_size - self.old_per_batch

    def steps(self) -> int:
        """Training steps per epoch."""
        return -(-self.counts[1] // self.new_per_batch)

    def plan(self) -> list[tuple[int, int]]:
        """(new, earlier) samples of each batch of an epoch; the last batch's share is in proportion."""
        n_new, k_new, k_old = self.counts[1], self.new_per_batch, self.old_per_batch
        out = []
        for start in range(0, n_new, k_new):
            new = min(k_new, n_new - start)
            out.append((new, k_old if new == k_new else int(round(new * k_old / k_new))))
        return out

    def prior_offsets(self, num_classes: int) -> torch.Tensor | None:
        """What replay's batches change in the class balance, as logit offsets ``log(q_c / p_c)``: ``q_c`` a
        class's share of the replay batches, ``p_c`` its share of the training data. Trained with them added
        (logit adjustment, Menon et al., ICLR 2021), the model estimates the classes' probabilities at the
        data's balance, as a training on every sample would, and not at the batches' (where a new class is
        half of every batch at ``replay: 0.5``, and would be predicted far too often). None without earlier
        samples in the batches (``replay: 0``): nothing to correct."""
        n_old, n_new = self.counts
        if self.old_per_batch == 0 or n_old == 0 or n_new == 0:
            return None
        total = n_old + n_new
        old = math.log(self.old_per_batch / self.batch_size * total / n_old)
        new = math.log(self.new_per_batch / self.batch_size * total / n_new)
        offsets = torch.full((num_classes,), new, dtype=torch.float32)
        offsets[list(self.old)] = old
        return offsets

    def _generator(self, epoch: int, salt: int) -> torch.Generator:
        return torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) * 7919 + salt)

    def batches(self, samples: Iterable[tuple[torch.Tensor, torch.Tensor]],
                epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The epoch's mixed batches, from the epoch's (shuffled) training samples."""
        xs, ys = [], []
        for x, y in samples:
            xs.append(x)
            ys.append(y)
        if not ys:
            return
        x_all, y_all = torch.cat(xs), torch.cat(ys)
        is_old = torch.isin(y_all, torch.tensor(self.old, dtype=y_all.dtype, device=y_all.device))
        old_pos = torch.nonzero(is_old).flatten().cpu()
        new_pos = torch.nonzero(~is_old).flatten().cpu()
        plan = self.plan()
        if len(new_pos) != self.counts[1] or (len(old_pos) == 0 and any(k for _, k in plan)):
            raise ModelError(f"replay: the training stream gave {len(new_pos)} new and {len(old_pos)} "
                             f"earlier samples in epoch {epoch}, {self.counts[1]} and {self.counts[0]} when "
                             "counted; a stream's samples must not change between passes")
        needed = sum(k for _, k in plan)
        drawn = [old_pos]
        total, rounds = len(old_pos), 0
        while total < needed:  # fewer earlier samples than the epoch needs: go round again, reshuffled
            rounds += 1
            drawn.append(old_pos[torch.randperm(len(old_pos), generator=self._generator(epoch, rounds))])
            total += len(old_pos)
        old_seq = torch.cat(drawn)
        n_at = o_at = 0
        for step, (new, old) in enumerate(plan):
            idx = torch.cat([new_pos[n_at:n_at + new], old_seq[o_at:o_at + old]])
            n_at, o_at = n_at + new, o_at + old
            idx = idx[torch.randperm(len(idx), generator=self._generator(epoch, 100_000 + step))]
            idx = idx.to(x_all.device)
            yield x_all[idx], y_all[idx]


# ------------------------------------------------------------------------------------ distillation
DISTILL_TEMPERATURE = 2.0  # Li & Hoiem's choice: softens the teacher's scores so every class's share counts


class Distillation:
    """Learning without Forgetting (Li & Hoiem, ECCV 2016) as a training loss: the stage's cross-entropy plus
    ``weight`` times the divergence of the model's scores on the init model's classes from the init
    model's own, at temperature ``DISTILL_TEMPERATURE`` (scaled by its square, so the term's gradient
    does not shrink with it), averaged over every sample of the batch (as LwF does, the new class's too).

    Why: replay keeps the known classes in the batches, but their labels say only which class is right;
    the init model's scores also say how a coat resembles a shirt, which training on a few hundred
    replayed samples otherwise forgets first. ``teacher`` is a frozen copy of the warm-started network
    made before training (its known rows are the init model's, bit for bit); it runs in eval mode on the
    step's own inputs: one more forward per step. (Distilling on the earlier samples only was measured
    too, on Fashion-MNIST: the new class kept 4 more points, the known classes lost 0.8 more, the whole
    the same; docs/methods.md.)
    """

    def __init__(self, teacher: nn.Module, columns: Sequence[int], weight: float, base: Any) -> None:
        self.teacher = teacher.eval().requires_grad_(False)
        self.columns = torch.tensor(list(columns), dtype=torch.int64)
        self.weight = weight
        self.base = base  # the stage's own loss (trainer.cross_entropy)

    @classmethod
    def of(cls, trained: nn.Module, columns: Sequence[int], weight: float, base: Any) -> Distillation:
        """The distillation loss for ``trained`` as it is now (copied: training does not move the teacher)."""
        import copy

        return cls(copy.deepcopy(trained), columns, weight, base)

    def __call__(self, logits: torch.Tensor, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        loss = self.base(logits, y, x)
        cols = self.columns.to(logits.device)
        with torch.no_grad():
            target = self.teacher(x).float().index_select(1, cols)
        student = logits.float().index_select(1, cols)
        t = DISTILL_TEMPERATURE
        kd = nn.functional.kl_div(nn.functional.log_softmax(student / t, 1),
                                  nn.functional.log_softmax(target / t, 1),
                                  log_target=True, reduction="batchmean")
        return loss + (self.weight * t * t) * kd


def prior_correction(top: nn.Module, offsets: torch.Tensor) -> Any:
    """Add ``offsets`` to ``top``'s class scores while it trains (not while it is evaluated); returns the
    hook's handle (``.remove()`` it when training ends). A hook on the classifier: no state dict changes."""
    _name, layer = zoo.final_layer(top)

    def shift(module: nn.Module, _inputs: Any, output: torch.Tensor) -> torch.Tensor:
        if not module.training:
            return output
        extra = offsets.to(output.device, output.dtype)
        return output + extra.view(1, -1, *[1] * (output.dim() - 2))

    return layer.register_forward_hook(shift)


def count_classes(batches: Iterable[tuple[Any, torch.Tensor]], old: Sequence[int]) -> tuple[int, int]:
    """(earlier, new) samples among ``batches`` (labels in ``old``: earlier)."""
    wanted = torch.tensor(list(old), dtype=torch.int64)
    n_old = n_all = 0
    for _x, y in batches:
        n_old += int(torch.isin(y, wanted.to(y.device)).sum())
        n_all += len(y)
    return n_old, n_all - n_old


@dataclass
class UpdateReport:
    """What a warm-started training did, for its result's metrics."""

    source: InitSource
    sha256: str
    plan: ClassPlan
    replay: Replay | None = None
    start_state_sha256: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def metrics(self) -> dict[str, Any]:
        out: dict[str, Any] = {"init": {"model_sha256": self.sha256, **self.plan.summary(),
                                        "start_state_sha256": self.start_state_sha256}}
        if self.source.entry is not None:
            out["init"]["stored_result"] = self.source.entry
        if self.replay is not None:
            out["replay"] = {"fraction": self.replay.fraction, "earlier_per_batch": self.replay.old_per_batch,
                             "new_per_batch": self.replay.new_per_batch,
                             "earlier_samples": self.replay.counts[0], "new_samples": self.replay.counts[1]}
        out.update(self.extra)
        return out
