"""A merge recipe as a typed, frozen value: mergekit's YAML subset, checked before any tensor is read.

    merge_method: ties
    base_model: base/
    models:
      - model: math/
        parameters: {weight: 0.6, density: 0.5}
      - model: code/
        parameters:
          weight: [0.2, 0.8]                       # a gradient over layer index
          density: [{filter: self_attn, value: 0.7}, {value: 0.5}]
    parameters: {lambda: 1.0}
    dtype: bfloat16

A parameter value is a number, a list of numbers (interpolated over the layer index, as
mergekit's gradients are), or a list of ``{filter, value}`` (the first whose ``filter``
is a substring of the tensor name, or has none, wins). A model's own ``parameters`` come
before the recipe's.
"""

from __future__ import annotations

import math
import numbers
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from restorekit.errors import InvalidArgumentError

__all__ = ["MergeRecipe", "ModelSpec", "layer_position", "load_recipe"]

RECIPE_KEYS = ("merge_method", "base_model", "models", "parameters", "dtype")
MODEL_KEYS = ("model", "parameters")
FILTER_KEYS = ("filter", "value")
DTYPES = ("float16", "bfloat16", "float32", "float64")

# A layer index in a name: 'model.layers.3.', 'model/layers/3/', 'encoder/layer_3/', 'h.3.', 'blocks.3.'
_LAYER = re.compile(r"(?:^|[./])(?:layers|layer|h|blocks|block)[._/](\d+)(?=[./_]|$)")


@dataclass(frozen=True)
class ModelSpec:
    """One input model: its path and its own parameters (name -> setting, highest precedence)."""

    path: str
    parameters: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class MergeRecipe:
    """A checked merge recipe (mergekit's ``merge_method``, ``base_model``, ``models``, ``parameters``, ``dtype``).

    Build one from a dict or YAML text with :meth:`from_dict` / :meth:`from_yaml`, or from a file
    with :func:`load_recipe`; every check runs in ``__post_init__``, so a recipe that exists is
    one the method can run (its sources still have to agree, which only reading them tells).

    Raises:
        InvalidArgumentError: an unknown key, method or parameter (the message lists the known
            ones), a missing base model where the method needs one, slerp without exactly two
            models, ``t`` outside [0, 1], ``density`` outside (0, 1], a dtype not in DTYPES.
    """

    merge_method: str
    models: tuple
    base_model: str | None = None
    parameters: Mapping[str, Any] = field(default_factory=dict)
    dtype: str | None = None

    def __post_init__(self) -> None:
        from restorekit._merging._methods import METHODS

        method = METHODS.get(self.merge_method)
        if method is None:
            raise InvalidArgumentError(f"unknown merge_method {self.merge_method!r}; known: {', '.join(METHODS)}")
        models = tuple(m if isinstance(m, ModelSpec) else ModelSpec(os.fspath(m)) for m in self.models)
        object.__setattr__(self, "models", models)
        object.__setattr__(self, "parameters", dict(self.parameters or {}))
        if self.base_model is not None:
            object.__setattr__(self, "base_model", os.fspath(self.base_model))
        if not models:
            raise InvalidArgumentError("a recipe lists one or more models under 'models'")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise InvalidArgumentError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if method.needs_base and self.base_model is None:
            raise InvalidArgumentError(f"merge_method {self.merge_method!r} needs a base_model: it merges the "
                                       "differences of each model from it")
        count = len(self.sources)
        if count < method.min_sources or (method.max_sources is not None and count > method.max_sources):
            wanted = (f"exactly {method.min_sources}" if method.max_sources == method.min_sources
                      else f"{method.min_sources} or more")
            raise InvalidArgumentError(f"merge_method {self.merge_method!r} takes {wanted} models (base included), "
                                       f"got {count}: {', '.join(self.sources)}")
        known = method.parameters
        for where, params in [("parameters", self.parameters)] + [
                (f"parameters of model {m.path!r}", m.parameters) for m in models]:
            for name, setting in params.items():
                if name not in known:
                    raise InvalidArgumentError(f"{where}: unknown parameter {name!r} for merge_method "
                                               f"{self.merge_method!r}; known: {', '.join(known) or 'none'}")
                _check_setting(name, setting, where)

    @property
    def sources(self) -> tuple:
        """Every model path the merge reads, in order: the models, then the base if they do not list it."""
        paths = tuple(m.path for m in self.models)
        if self.base_model is not None and self.base_model not in paths:
            paths += (self.base_model,)
        return paths

    @property
    def base_index(self) -> int | None:
        return None if self.base_model is None else self.sources.index(self.base_model)

    def setting(self, name: str, path: str | None):
        """The settings of parameter ``name`` for model ``path`` (None: the recipe's), highest precedence first."""
        found = []
        for m in self.models:
            if path is not None and m.path == path and name in m.parameters:
                found.append(m.parameters[name])
        if name in self.parameters:
            found.append(self.parameters[name])
        return found

    def resolve(self, name: str, path: str | None, tensor: str, t: float, default):
        """The value of parameter ``name`` for model ``path`` on ``tensor`` at layer position ``t``."""
        for setting in self.setting(name, path):
            value = evaluate(setting, tensor, t)
            if value is not None:
                return value
        return default

    @classmethod
    def from_dict(cls, recipe: Mapping) -> "MergeRecipe":
        """A recipe from a mapping (parsed YAML); unknown keys are an error listing the known ones."""
        if not isinstance(recipe, Mapping):
            raise InvalidArgumentError(f"a recipe is a mapping of {', '.join(RECIPE_KEYS)}, got {type(recipe).__name__}")
        _known_keys(recipe, RECIPE_KEYS, "recipe")
        if "merge_method" not in recipe:
            raise InvalidArgumentError("a recipe names its merge_method")
        models = recipe.get("models")
        if not isinstance(models, list):
            raise InvalidArgumentError("'models' is a list of {model: PATH, parameters: {...}}")
        specs = []
        for m in models:
            if isinstance(m, str):
                specs.append(ModelSpec(m))
                continue
            if not isinstance(m, Mapping) or "model" not in m:
                raise InvalidArgumentError(f"each entry of 'models' is {{model: PATH, parameters: ...}}, got {m!r}")
            _known_keys(m, MODEL_KEYS, f"model {m.get('model')!r}")
            params = m.get("parameters") or {}
            if not isinstance(params, Mapping):
                raise InvalidArgumentError(f"parameters of model {m['model']!r} is a mapping, got {params!r}")
            specs.append(ModelSpec(str(m["model"]), dict(params)))
        params = recipe.get("parameters") or {}
        if not isinstance(params, Mapping):
            raise InvalidArgumentError(f"'parameters' is a mapping, got {params!r}")
        base = recipe.get("base_model")
        return cls(str(recipe["merge_method"]), tuple(specs), None if base is None else str(base), dict(params),
                   recipe.get("dtype"))

    @classmethod
    def from_yaml(cls, text: str) -> "MergeRecipe":
        """A recipe from YAML text (PyYAML's safe loader)."""
        import yaml  # type: ignore[import-untyped]

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise InvalidArgumentError(f"the recipe is not valid YAML: {e}") from None
        return cls.from_dict(data)


def load_recipe(recipe) -> MergeRecipe:
    """A MergeRecipe as it is, from a mapping, or from a YAML file's path."""
    if isinstance(recipe, MergeRecipe):
        return recipe
    if isinstance(recipe, Mapping):
        return MergeRecipe.from_dict(recipe)
    if isinstance(recipe, (str, os.PathLike)):
        path = os.fspath(recipe)
        if not os.path.isfile(path):
            from restorekit.errors import CheckpointNotFoundError

            raise CheckpointNotFoundError(f"no recipe file at {path!r}")
        with open(path, encoding="utf-8") as f:
            return MergeRecipe.from_yaml(f.read())
    raise InvalidArgumentError(f"a recipe is a MergeRecipe, a mapping or a YAML file's path, got {recipe!r}")


def _known_keys(mapping: Mapping, known: tuple, where: str) -> None:
    unknown = [k for k in mapping if k not in known]
    if unknown:
        raise InvalidArgumentError(f"{where}: unknown key {unknown[0]!r}"
                                   f"{f' (and {len(unknown) - 1} more)' if len(unknown) > 1 else ''}; "
                                   f"known: {', '.join(known)}")


# ------------------------------------------------------------------ settings

_RANGES = {"t": (0.0, 1.0, True, "[0, 1]"), "density": (0.0, 1.0, False, "(0, 1]")}


def _leaves(setting, name: str, where: str):
    """Every plain value of a setting (filters and gradients opened), checking its shape."""
    if isinstance(setting, Mapping):
        _known_keys(setting, FILTER_KEYS, f"{where}: {name}")
        if "value" not in setting:
            raise InvalidArgumentError(f"{where}: {name}: a filtered value is {{filter: TEXT, value: ...}}")
        yield from _leaves(setting["value"], name, where)
    elif isinstance(setting, list):
        if not setting:
            raise InvalidArgumentError(f"{where}: {name} is an empty list")
        for s in setting:
            yield from _leaves(s, name, where)
    else:
        yield setting


def _check_setting(name: str, setting, where: str) -> None:
    for value in _leaves(setting, name, where):
        if name in ("normalize", "rescale"):
            if not isinstance(value, bool):
                raise InvalidArgumentError(f"{where}: {name} is true or false, got {value!r}")
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise InvalidArgumentError(f"{where}: {name} is a finite number, got {value!r}")
        if name in _RANGES:
            low, high, closed, text = _RANGES[name]
            number = float(value)
            if not ((low <= number if closed else low < number) and number <= high):
                raise InvalidArgumentError(f"{where}: {name}={value!r} is outside {text}")


def evaluate(setting, tensor: str, t: float):
    """A setting's value on ``tensor`` at layer position ``t`` (0 first layer, 1 last), as mergekit's
    ``evaluate_setting``: a number as it is; a list of numbers interpolated at ``t``; a list of
    ``{filter, value}`` the first whose filter is in the name (or absent, or '*'). None: no filter matched."""
    if isinstance(setting, Mapping):
        setting = [setting]
    if not isinstance(setting, list):
        return setting
    if all(not isinstance(s, (Mapping, list)) for s in setting):
        if any(isinstance(s, bool) for s in setting):
            return setting[int(t * (len(setting) - 1))]
        scaled = t * (len(setting) - 1)
        i0 = int(scaled)
        i1 = min(len(setting) - 1, i0 + 1)
        frac = scaled - i0
        return (1 - frac) * setting[i0] + frac * setting[i1]
    for cond in setting:
        if not isinstance(cond, Mapping):
            continue
        pattern = cond.get("filter")
        if pattern is None or pattern == "*" or (tensor and pattern in tensor):
            return evaluate(cond["value"], tensor, t)
    return None


def layer_position(names) -> dict:
    """{name: t} for names holding a layer index: index / (number of layers - 1), as mergekit's slices
    give it (one layer: 1); names without an index (embeddings, final norm, head) are at 0."""
    found = {}
    for name in names:
        m = _LAYER.search(name)
        if m is not None:
            found[name] = int(m.group(1))
    count = max(found.values()) + 1 if found else 0
    return {n: (found[n] / (count - 1) if count > 1 else 1.0) if n in found else 0.0 for n in names}
