"""YAML recipes validated into frozen typed models.

Errors name the recipe file, the line, the field path, what was expected and the
nearest valid name for a typo. ``yaml.safe_load`` only: a recipe is data, and the
only things it can instantiate are registered stage types.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any, Literal, NoReturn

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import ErrorDetails

from .device import check_device_name
from .errors import MissingPathError, ModelError, RecipeError, did_you_mean
from .recipe_model import RecipeModel
from .registry import stage_class
from .stage import Stage

STAGE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*$")
# A recipe is a few kB of YAML. Limits that refuse a hostile or wrong file quickly and in little memory,
# far beyond any real recipe: its size, the values it expands to through YAML aliases ("billion
# laughs": each level repeats the one before), and how deeply it nests.
MAX_RECIPE_BYTES = 1 << 20
MAX_YAML_VALUES = 100_000
MAX_YAML_DEPTH = 64

Path_ = tuple[str | int, ...]


class StoreConfig(RecipeModel):
    path: str | None = Field(
        None, description="store directory; default $ONDEVICE_TL_STORE or a per-user cache"
    )
    max_bytes: int | None = Field(None, ge=0, description="size budget for the store (bytes)")


class RunConfig(RecipeModel):
    device: str = Field(
        "cpu",
        description="where the stages compute: cpu, cuda, cuda:N (a GPU's index) or auto (CUDA when "
        "available, else cpu); never part of a fingerprint",
    )
    threads: int | Literal["auto"] = Field(
        "auto",
        description="torch intra-op threads: auto (the cores this process may use, adapted while training "
        "when other work slows the steps down) or a fixed count >= 1",
    )
    deterministic: bool = Field(
        True,
        description="true: training and evaluation on a CPU compute in fixed micro-batches, one thread "
        "each, so results are the same bytes at any thread count or load (pipeline/methods/microbatch.py); "
        "false: intra-op threads, a little faster where batches are large, with last bits that follow "
        "the thread count (recorded: trained entries get other fingerprints)",
    )

    @field_validator("device", mode="before")
    @classmethod
    def _device(cls, value: Any) -> str:
        return check_device_name(value)

    @field_validator("threads", mode="before")
    @classmethod
    def _threads(cls, value: Any) -> int | Literal["auto"]:
        # One message for every wrong value: pydantic's union errors would list each member's.
        if value == "auto":
            return "auto"
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
        raise ValueError("expected auto or an int >= 1 (a fixed number of threads)")


class ExecutorConfig(RecipeModel):
    """Where stage A's cache build runs: in this process (``local``) or on a Dask cluster (``dask``).

    Never part of a fingerprint: where the work runs does not change what is stored, so a
    cache built on a cluster is reused by a device's local run and the other way round.
    """

    type: Literal["local", "dask"] = "local"
    address: str | None = Field(
        None,
        description="dask: a running scheduler to use, e.g. tcp://HOST:8786 (workers must share the store)",
    )
    workers: int | None = Field(
        None, ge=1, description="dask: start a local cluster of this many worker processes for the run"
    )
    threads_per_worker: int = Field(
        1, ge=1, description="dask local cluster: partitions each worker runs at once"
    )
    torch_threads: int = Field(1, ge=1, description="dask: torch intra-op threads in each worker process")
    retries: int = Field(
        2, ge=0, description="dask: times a failed partition is retried before the build fails"
    )
    partition_chunks: int | None = Field(
        None, ge=1, description="dask: cache chunks per task, in every split; default: about 4 partitions "
        "per worker thread, of about the same number of samples"
    )
    connect_timeout: float = Field(
        10.0, gt=0, description="dask: seconds to wait for the scheduler at address"
    )

    @model_validator(mode="after")
    def _where(self) -> ExecutorConfig:
        if self.type == "dask" and self.address is None and self.workers is None:
            raise ValueError(
                "type: dask needs address (a running scheduler, e.g. tcp://HOST:8786) or workers "
                "(start a local cluster of N worker processes)"
            )
        if self.type == "dask" and self.address is not None and self.workers is not None:
            raise ValueError(
                "type: dask takes address (use a running scheduler) or workers (start a local cluster), "
                "not both"
            )
        if self.type == "local" and (self.address is not None or self.workers is not None):
            raise ValueError(
                "address and workers are only used with type: dask; set type: dask or remove them"
            )
        return self


class Recipe(RecipeModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "<recipe>") -> Recipe:
        """:func:`recipe_from_dict` reached through a recipe's class: code below the config layer (a
        Dask worker) re-creates a recipe it was handed without importing this module."""
        return recipe_from_dict(data, source=source)

    name: str
    description: str = ""
    seed: int = 0
    store: StoreConfig = StoreConfig()
    run: RunConfig = RunConfig()
    executor: ExecutorConfig = ExecutorConfig()
    stages: dict[str, Stage]
    targets: tuple[str, ...] | None = None
    source: str = Field("<recipe>", exclude=True)

    def resolved_dict(self) -> dict[str, Any]:
        """The recipe as run (defaults omitted, overrides applied), JSON-able."""
        out = self.model_dump(mode="json", exclude={"stages", "source"}, exclude_defaults=True)
        out["name"] = self.name
        out["stages"] = {name: stage.to_config() for name, stage in self.stages.items()}
        return out

    def full_dict(self) -> dict[str, Any]:
        """The recipe as run with every default written out (overrides applied), JSON-able.

        What a run record keeps: a reader sees every setting the run used without knowing this
        version's defaults, and loading it back gives the same stages, so the same fingerprints
        (they hash non-default values, whether a default was written or left out).
        """
        out = self.model_dump(mode="json", exclude={"stages", "source"})
        out["stages"] = {
            name: {"type": stage.type_name, **stage.model_dump(mode="json")}
            for name, stage in self.stages.items()
        }
        if out.get("targets") is None:
            out.pop("targets", None)
        return out


# ---------------------------------------------------------------------------- loading
class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A mapping gives one key twice: plain YAML keeps the last silently, a recipe refuses."""

    def __init__(self, key: Any, first: yaml.Mark, second: yaml.Mark) -> None:
        super().__init__(None, None, f"duplicate key {key!r}", second)
        self.key, self.first_line, self.second_line = key, first.line + 1, second.line + 1


class RecipeLoader(yaml.SafeLoader):
    """``yaml.safe_load``'s loader (plain data only, no arbitrary tags) that refuses duplicate keys.

    Two stages with one name, or a field given twice, would otherwise leave only the last, and the
    run would quietly differ from what the file seems to say. Keys brought in by a merge (``<<:``)
    are defaults that the mapping's own keys may override, as YAML intends, so they are not counted.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Mark] = {}
        for key_node, _value in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: the base constructor names it
                continue
            if first is not None:
                raise DuplicateKeyError(key, first, key_node.start_mark)
            seen[key] = key_node.start_mark
        mapping: dict[Any, Any] = super().construct_mapping(node, deep=deep)
        return mapping


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` semantics, refusing duplicate keys (:class:`RecipeLoader`)."""
    return yaml.load(text, Loader=RecipeLoader)  # noqa: S506 -- a SafeLoader subclass


def _unshared(value: Any) -> Any:
    """A copy in which no mapping or list appears twice.

    YAML anchors and aliases (``train: &transfer`` ... ``train: *transfer``) load as one shared
    object; an override of one stage must not change every stage that names the anchor.
    """
    if isinstance(value, dict):
        return {k: _unshared(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unshared(v) for v in value]
    return value


# ---------------------------------------------------------------------------- lines
def _yaml_problem(exc: yaml.YAMLError, source: str, what: str) -> str:
    """'file:LINE: what: problem', naming the line where the broken construct starts.

    An unclosed bracket is only noticed at the end of the file; the line that opened it
    (pyyaml's context mark) is the one the user has to fix.
    """
    context = getattr(exc, "context_mark", None)
    mark = context or getattr(exc, "problem_mark", None)
    where = f"{source}:{mark.line + 1}" if mark else source
    if isinstance(exc, yaml.reader.ReaderError):  # a character YAML does not allow: no mark, a position
        return f"{where}: {what}: character #x{exc.character:04x} at offset {exc.position}: {exc.reason}"
    detail = getattr(exc, "problem", None) or " ".join(str(exc).split())
    if context is not None and getattr(exc, "context", None):
        problem_mark = getattr(exc, "problem_mark", None)
        at = f" at line {problem_mark.line + 1}" if problem_mark else ""
        detail = f"{getattr(exc, 'context', '')} starting here: {detail}{at}"
    return f"{where}: {what}: {detail}"


def read_recipe_text(path: Path) -> str:
    """The recipe file's text: UTF-8 (a byte-order mark allowed), at most ``MAX_RECIPE_BYTES``; anything
    else is refused naming the file (and the line of the first byte that is not UTF-8)."""
    size = path.stat().st_size
    if size > MAX_RECIPE_BYTES:
        raise RecipeError(f"{path}: the recipe file has {size} bytes; a recipe is at most {MAX_RECIPE_BYTES} "
                          "bytes of YAML (is this the recipe file?)")
    raw = path.read_bytes()
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise RecipeError(f"{path}: the recipe is UTF-16 text; save it as UTF-8")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise RecipeError(f"{path}:{line}: the recipe is not UTF-8 text (byte 0x{raw[exc.start]:02x} at "
                          f"column {column}); save it as UTF-8") from None


def _check_expansion(root: yaml.Node, source: str) -> None:
    """Refuse a node tree that aliases make huge, self-referencing, or nest too deeply (before anything
    expands it: pyyaml shares an aliased node, and the loaded data would repeat it)."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node: yaml.Node, depth: int) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        line = node.start_mark.line + 1
        if key in open_nodes:
            raise RecipeError(f"{source}:{line}: an alias refers to a node that contains it (a "
                              "self-referencing anchor); a recipe must be a tree")
        if depth > MAX_YAML_DEPTH:
            raise RecipeError(f"{source}:{line}: nested more than {MAX_YAML_DEPTH} levels deep")
        open_nodes.add(key)
        n = 1
        if isinstance(node, yaml.MappingNode):
            n += sum(size(k, depth + 1) + size(v, depth + 1) for k, v in node.value)
        elif isinstance(node, yaml.SequenceNode):
            n += sum(size(v, depth + 1) for v in node.value)
        open_nodes.discard(key)
        if n > MAX_YAML_VALUES:
            raise RecipeError(f"{source}:{line}: this expands to more than {MAX_YAML_VALUES} values through "
                              "YAML aliases (aliases that repeat aliases: an 'alias bomb'?); a recipe has "
                              "far fewer")
        sizes[key] = n
        return n

    size(root, 0)


def _line_map(text: str, source: str) -> dict[Path_, int]:
    """Field path -> 1-based line, from the safe composer's node tree (checked by :func:`_check_expansion`
    first, so walking it cannot blow up)."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        raise RecipeError(_yaml_problem(exc, source, "not valid YAML")) from None
    except RecursionError:  # pyyaml's composer recurses once per nesting level
        raise RecipeError(f"{source}: nested more than {MAX_YAML_DEPTH} levels deep") from None
    if root is not None:
        _check_expansion(root, source)
    lines: dict[Path_, int] = {}

    def walk(node: yaml.Node, path: Path_) -> None:
        lines[path] = node.start_mark.line + 1
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                child = (*path, key.value)
                lines[child] = key.start_mark.line + 1
                walk(value, child)
                lines[child] = key.start_mark.line + 1
        elif isinstance(node, yaml.SequenceNode):
            for i, value in enumerate(node.value):
                walk(value, (*path, i))

    if root is not None:
        walk(root, ())
    return lines


def _where(source: str, lines: dict[Path_, int], path: Path_, overridden: set[Path_]) -> str:
    for n in range(len(path), -1, -1):
        if path[:n] in overridden:
            return f"{source} (--set {'.'.join(map(str, path[:n]))})"
        if path[:n] in lines:
            return f"{source}:{lines[path[:n]]}"
    return source


# ------------------------------------------------------------------------ overrides
def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise RecipeError(f"--set expects KEY.PATH=VALUE, got {text!r}")
    key, raw = text.split("=", 1)
    parts = [p for p in key.strip().split(".")]
    if not all(parts):
        raise RecipeError(f"--set {text!r}: empty component in key path {key!r}")
    try:
        value = load_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise RecipeError(f"--set {text!r}: value is not valid YAML: {exc}") from None
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> set[Path_]:
    touched: set[Path_] = set()
    for text in overrides:
        parts, value = parse_override(text)
        node: Any = data
        for i, part in enumerate(parts[:-1]):
            if isinstance(node, list):
                node = node[int(part)]
                continue
            if not isinstance(node, dict):
                raise RecipeError(f"--set {text!r}: {'.'.join(parts[:i])} is not a mapping")
            node = node.setdefault(part, {})
            if node is None:
                node = {}
        if not isinstance(node, dict):
            raise RecipeError(f"--set {text!r}: {'.'.join(parts[:-1])} is not a mapping")
        node[parts[-1]] = value
        touched.add(tuple(parts))
    return touched


# ------------------------------------------------------------------------- validate
def _describe(err: ErrorDetails, model: type[BaseModel] | None) -> str:
    kind = err["type"]
    loc = err["loc"]
    if kind == "extra_forbidden" and model is not None:
        key = str(loc[-1])
        valid = [k for k in model.model_fields if k != "source"]
        return f"unknown key {key!r}{did_you_mean(key, valid)}; valid keys: {', '.join(valid)}"
    if kind == "missing":
        return "required field is missing"
    found = err.get("input")
    message = err["msg"].removeprefix("Value error, ")  # our own validators' messages read as the others'
    return f"{message}; found {found!r}"


def _raise(
    errors: list[tuple[Path_, str]], source: str, lines: dict[Path_, int], overridden: set[Path_]
) -> NoReturn:
    msgs = []
    for path, text in errors:
        dotted = ".".join(map(str, path)) or "<top>"
        msgs.append(f"{_where(source, lines, path, overridden)}: {dotted}: {text}")
    raise RecipeError("invalid recipe:\n  " + "\n  ".join(msgs))


def recipe_from_dict(
    data: Any,
    *,
    source: str = "<recipe>",
    lines: dict[Path_, int] | None = None,
    overridden: set[Path_] | None = None,
) -> Recipe:
    lines = lines or {}
    overridden = overridden or set()
    if not isinstance(data, dict):
        _raise(
            [((), f"expected a mapping at the top, found {type(data).__name__}")], source, lines, overridden
        )
    errors: list[tuple[Path_, str]] = []
    stages_raw = data.get("stages")
    stages: dict[str, Stage] = {}
    if not isinstance(stages_raw, dict) or not stages_raw:
        errors.append((("stages",), "expected a non-empty mapping of stage name -> {type: ..., ...}"))
        stages_raw = {}
    for name, cfg in stages_raw.items():
        path: Path_ = ("stages", name)
        if not isinstance(name, str) or not STAGE_NAME.match(name):
            errors.append((path, f"stage names must match {STAGE_NAME.pattern}, found {name!r}"))
            continue
        if not isinstance(cfg, dict) or "type" not in cfg:
            errors.append((path, "expected a mapping with a 'type:' key"))
            continue
        try:
            cls = stage_class(str(cfg["type"]))
        except RecipeError as exc:
            errors.append(((*path, "type"), str(exc)))
            continue
        body = {k: v for k, v in cfg.items() if k != "type"}
        # The recipe's seed is every stage's default seed: `--set seed=1` reruns it all.
        if "seed" in cls.model_fields and "seed" not in body and isinstance(data.get("seed", 0), int):
            body["seed"] = data.get("seed", 0)
        try:
            stages[name] = cls.model_validate(body)
        except ValidationError as exc:
            for err in exc.errors():
                errors.append(((*path, *err["loc"]), _describe(err, _model_at(cls, err["loc"]))))
    top = {k: v for k, v in data.items() if k != "stages"}
    try:
        recipe = Recipe.model_validate({**top, "stages": stages, "source": source})
    except ValidationError as exc:
        for err in exc.errors():
            if err["loc"][:1] == ("stages",):
                continue
            errors.append((tuple(err["loc"]), _describe(err, _model_at(Recipe, err["loc"]))))
        recipe = None
    if errors:
        _raise(errors, source, lines, overridden)
    assert recipe is not None
    return recipe


def _model_at(model: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model that owns the last element of ``loc`` (for 'unknown key' hints)."""
    current: type[BaseModel] | None = model
    for part in loc[:-1]:
        if current is None or not isinstance(part, str) or part not in current.model_fields:
            return None
        annotation = current.model_fields[part].annotation
        current = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    return current


def _model_problems(recipe: Recipe) -> list[tuple[Path_, str]] | None:
    """Cuts checked against the architecture they cut (None: torch is not installed, nothing checked).

    ``plan`` and ``run`` find the same problems while resolving; ``validate`` finds them too, so a
    recipe that validates does not fail later on a cut outside its backbone. Needs the block list,
    so torch: a Python with only the recipe tools skips this check.
    """
    if importlib.util.find_spec("torch") is None:
        return None
    from .models.arch import ArchConfig, check_cut

    problems: list[tuple[Path_, str]] = []
    specs: dict[str, Any] = {}
    for name, stage in recipe.stages.items():
        cut, model_name = getattr(stage, "train_last_blocks", None), getattr(stage, "model", None)
        if not isinstance(cut, int) or not isinstance(model_name, str):
            continue
        model = recipe.stages.get(model_name)
        arch = getattr(model, "arch", None)
        if model is None or not isinstance(arch, str):
            continue  # a model made another way (graph checks say if the name is wrong)
        if model_name not in specs:
            # The block count does not depend on the classes; a pretrain's come from its data.
            config = ArchConfig(arch, getattr(model, "num_classes", 1000), getattr(model, "width_mult", 1.0),
                                getattr(model, "small_input", False), getattr(model, "resolution", 224))
            try:
                specs[model_name] = config.spec()
            except ModelError as exc:
                specs[model_name] = None
                problems.append((("stages", model_name, "arch"), str(exc)))
        if specs[model_name] is None:
            continue
        try:
            check_cut(cut, specs[model_name])
        except ModelError as exc:
            where = ("stages", name, "train_last_blocks")
            problems.append((where, f"{exc}, the backbone made by stages.{model_name}"))
    return problems


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """The recipe at ``path`` with ``overrides`` applied, validated without torch."""
    return _load(path, overrides, check_models=False)[0]


def validate_recipe(path: str | Path, overrides: list[str] | None = None) -> tuple[Recipe, bool]:
    """(recipe, whether its cuts were checked against their architectures): ``load_recipe`` plus the
    checks that need the model's structure, which are skipped where torch is not installed."""
    return _load(path, overrides, check_models=True)


def _load(path: str | Path, overrides: list[str] | None, *, check_models: bool) -> tuple[Recipe, bool]:
    path = Path(path)
    if not path.is_file():
        raise MissingPathError(
            f"recipe file not found: {path} (expected a YAML file, e.g. recipes/quickstart.yaml)"
        )
    text = read_recipe_text(path)
    source = str(path)
    lines = _line_map(text, source)
    try:
        data = load_yaml(text)
    except DuplicateKeyError as exc:
        raise RecipeError(
            f"{source}:{exc.second_line}: duplicate key {exc.key!r}, first given at line {exc.first_line}; "
            "a key may appear once in a mapping (YAML would keep only the last): remove or rename one"
        ) from None
    except yaml.YAMLError as exc:  # e.g. a python/object tag: recipes are plain data
        raise RecipeError(_yaml_problem(exc, source, "not a plain-data recipe")) from None
    if data is None:
        raise RecipeError(f"{source}: the recipe is empty")
    data = _unshared(data)
    overridden = apply_overrides(data, overrides or []) if isinstance(data, dict) else set()
    recipe = recipe_from_dict(data, source=source, lines=lines, overridden=overridden)
    if not check_models:
        return recipe, False
    problems = _model_problems(recipe)
    if problems:
        _raise(problems, source, lines, overridden)
    return recipe, problems is not None
