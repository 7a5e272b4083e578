"""The ``memory`` command's work: the training memory of every trainer of a recipe, nothing trained.

Engine-level: it resolves the recipe through the runner and asks each trainer stage for its
footprint (``Finetune.footprint_from_specs``, metered by ``pipeline.models.memory``) or its
memory plan (NeuroFlux and backprop).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import StageError
from .graph import Graph
from .methods.finetune import Finetune
from .models.memory import check_convention
from .runner import Runner

if TYPE_CHECKING:
    from .context import RunContext
    from .recipe import Recipe


def memory_report(recipe: Recipe, ctx: RunContext, *, stages: list[str] | None = None,
                  measure: bool = True, convention: str = "mask") -> tuple[str, dict[str, Any]]:
    """Training-memory footprint of every ``finetune`` stage of ``recipe`` (or of ``stages``).

    Resolves the recipe (specs only: no backbone is pretrained, no cache built; weights are
    random because memory does not depend on their values), builds each trainer's top as its
    ``method`` makes it, and meters one training step at the stage's batch size. Returns the
    text ``python -m pipeline memory`` prints and a JSON-able dict ``{"recipe", "stages":
    {name: footprint}}``. ``convention`` is the analytic count's (``"mask"`` or ``"map"``; see
    ``pipeline.models.memory``).
    """
    try:
        check_convention(convention)
    except ValueError as e:
        raise StageError(f"memory: {e}") from None
    graph = Graph(recipe)  # names first: a wrong name fails before any dataset is indexed
    # Finetune stages are metered for one step; stages trained under a budget (neuroflux, backprop)
    # show their profiled memory lines and what they would train at (``memory_plan``).
    names = [
        n
        for n in graph.order
        if n in graph.needed
        and (isinstance(recipe.stages[n], Finetune) or hasattr(recipe.stages[n], "memory_plan"))
    ]
    if stages is not None:
        unknown = [s for s in stages if s not in names]
        if unknown:
            raise StageError(f"memory: {unknown} are not trainer stages of {recipe.name}; "
                             f"expected some of {names}")
        names = [n for n in names if n in stages]
    if not names:
        raise StageError(f"memory: recipe {recipe.name} has no trainer stage among its targets")
    runner = Runner(recipe, ctx)
    text = [f"training memory of {recipe.name} ({recipe.source}), one step per trainer, "
            f"on {ctx.torch_device}"]
    out: dict[str, Any] = {"recipe": recipe.name, "device": str(ctx.torch_device), "stages": {}}
    for name in names:
        stage: Finetune = recipe.stages[name]  # type: ignore[assignment]
        if not isinstance(stage, Finetune):
            plan_text, plan = stage.memory_plan(runner.specs[stage.input], device=ctx.torch_device)
            text += ["", f"[{name}] {stage.type_name}, budget {plan['budget_mib']:.2f} MiB", plan_text]
            out["stages"][name] = plan
            continue
        fp = stage.footprint_from_specs(runner.specs, ctx, measure=measure, convention=convention)
        text += ["", f"[{name}] {fp.label}, input {tuple(fp.input_shape)}", fp.table()]
        out["stages"][name] = fp.as_dict()
    return "\n".join(text), out
