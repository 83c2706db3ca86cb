"""LoRA in and out: a PEFT adapter merged into a base checkpoint of any format, Keras LoRA weights merged
into their kernels or exported as a PEFT adapter, every path through the one ``delta`` function.

PEFT (``tuners/lora/layer.py``) saves a LoRA ``Linear`` as ``base_model.model.<module>.lora_A.weight``
``[r, in]`` and ``lora_B.weight`` ``[out, r]`` (an ``Embedding`` as ``lora_embedding_A`` / ``_B``, its
delta transposed); its ``get_delta_weight`` is ``transpose(B @ A, fan_in_fan_out) * scaling``.
Keras' ``enable_lora`` keeps ``lora_kernel_a`` ``[*in, r]`` and ``lora_kernel_b`` ``[r, out]`` and merges
``kernel + (lora_alpha / rank) * (a @ b)``: the same delta with ``A = a.T``, ``B = b.T``, transposed.

``merge_lora`` plans from names and shapes (the adapter's config and tensors against the base's
entries) and refuses before anything is written; then it streams the base tensor by tensor
(read, add the delta where targeted, write) through the format writers' one commit path.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import numpy as np

from restorekit.errors import InvalidArgumentError, OptionNotApplicableError, SourceMismatchError, format_names
from restorekit._registry import Source
from restorekit._report import summary_row

__all__ = ["AdapterConfig", "LoraExportResult", "LoraMergeResult", "delta", "export_lora_adapter", "merge_lora",
           "read_adapter", "scaling"]

ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
PREFIX = "base_model.model."
KERAS_LEAVES = ("lora_kernel_a", "lora_kernel_b")
# PEFT's saved key of one factor: module, the factor's kind ('' Linear, 'embedding_'), A or B.
_KEY = re.compile(r"(?P<module>.+)\.lora_(?P<kind>embedding_)?(?P<ab>[AB])(?:\.weight)?")


def delta(A: np.ndarray, B: np.ndarray, scaling: float, fan_in_fan_out: bool = False) -> np.ndarray:
    """PEFT's ``get_delta_weight`` of one LoRA pair, in float64: ``(B @ A) * scaling``, transposed for
    ``fan_in_fan_out`` (a weight stored ``[in, out]``: GPT-2's ``Conv1D``, an embedding, a Keras kernel).

    Args:
        A: ``[r, in]``.
        B: ``[out, r]``.
        scaling: ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA), see :func:`scaling`.
        fan_in_fan_out: the weight is ``[in, out]``.

    Returns:
        ``[out, in]``, or ``[in, out]`` with ``fan_in_fan_out``.
    """
    product = np.asarray(B, np.float64) @ np.asarray(A, np.float64) * float(scaling)
    return product.T if fan_in_fan_out else product


def scaling(r: int, lora_alpha: float, use_rslora: bool = False) -> float:
    """``lora_alpha / r``, or with rsLoRA ``lora_alpha / sqrt(r)`` (as PEFT's ``LoraLayer.update_layer``)."""
    return float(lora_alpha) / (math.sqrt(r) if use_rslora else r)


# ------------------------------------------------------------------ the adapter
@dataclass(frozen=True)
class AdapterConfig:
    """What of a PEFT ``adapter_config.json`` a merge uses; everything else that would change the
    merged weights is refused by name when read (:func:`read_adapter`)."""

    r: int
    lora_alpha: float
    target_modules: tuple = ()
    fan_in_fan_out: bool = False
    use_rslora: bool = False
    rank_pattern: tuple = ()  # ((pattern, r), ...)
    alpha_pattern: tuple = ()

    def rank_and_scaling(self, module: str) -> tuple[int, float]:
        """(r, scaling) of ``module``, its ``rank_pattern`` / ``alpha_pattern`` entry first (PEFT's ``get_pattern_key``)."""
        r = _pattern_value(self.rank_pattern, module, self.r)
        return int(r), scaling(int(r), _pattern_value(self.alpha_pattern, module, self.lora_alpha), self.use_rslora)


def _pattern_value(patterns: tuple, module: str, default):
    for key, value in patterns:  # an exact name first, then a pattern matching the name's end
        if key == module:
            return value
    for key, value in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


# Config keys whose value changes the merged weights (or adds weights), with what restorekit does not merge.
_REFUSED = {
    "use_dora": "DoRA (use_dora) rescales each column by a learned magnitude",
    "lora_bias": "lora_bias trains a bias of lora_B",
    "modules_to_save": "modules_to_save saves whole modules beside the adapter",
    "trainable_token_indices": "trainable_token_indices saves token embeddings beside the adapter",
    "use_qalora": "QA-LoRA pools the input before lora_A",
    "use_bdlora": "BD-LoRA",
    "alora_invocation_tokens": "aLoRA activates only after its invocation tokens",
    "layer_replication": "layer_replication adds layers to the base",
}


@dataclass(frozen=True)
class Adapter:
    """A PEFT adapter read for a merge: its config, source and ``{module: (A key, B key, embedding?)}``."""

    path: str
    config: AdapterConfig
    source: Source
    modules: dict


def read_config(path: str) -> AdapterConfig:
    """The ``adapter_config.json`` at ``path``, checked: a LoRA adapter restorekit merges exactly."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise InvalidArgumentError(f"no {CONFIG_FILE} at {path!r}: a PEFT adapter directory holds {ADAPTER_FILE} "
                                   f"and {CONFIG_FILE} (PeftModel.save_pretrained)") from None
    except (OSError, ValueError) as e:
        raise InvalidArgumentError(f"{path!r} is not a readable JSON adapter config ({e})") from None
    if not isinstance(raw, dict):
        raise InvalidArgumentError(f"{path!r} holds no JSON object")
    peft_type = str(raw.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise InvalidArgumentError(f"{path!r} is a {peft_type} adapter; merge_lora merges LoRA adapters only")
    refused = [f"{key}: {why}" for key, why in _REFUSED.items() if raw.get(key) not in (None, False, [], {}, "")]
    if raw.get("bias", "none") != "none":
        refused.append(f"bias={raw['bias']!r}: the adapter trains biases of the base")
    if refused:
        raise InvalidArgumentError(f"{path!r} asks for what merge_lora does not merge (nothing was written):\n  "
                                   + "\n  ".join(refused))
    r, alpha = raw.get("r"), raw.get("lora_alpha", raw.get("r"))
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise InvalidArgumentError(f"{path!r}: r is a positive int, got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise InvalidArgumentError(f"{path!r}: lora_alpha is a number, got {alpha!r}")
    targets = raw.get("target_modules") or ()
    return AdapterConfig(r, float(alpha), (targets,) if isinstance(targets, str) else tuple(targets),
                         bool(raw.get("fan_in_fan_out", False)), bool(raw.get("use_rslora", False)),
                         tuple((raw.get("rank_pattern") or {}).items()), tuple((raw.get("alpha_pattern") or {}).items()))


def read_adapter(path) -> Adapter:
    """A PEFT adapter directory (``adapter_model.safetensors`` + ``adapter_config.json``), checked from its
    config and tensor names and shapes, no tensor read.

    Raises:
        InvalidArgumentError: no such adapter, a config it does not merge (DoRA, ``lora_bias``,
            ``modules_to_save``, biases, another PEFT type), a tensor that is no LoRA factor, a
            module with one factor, or factors whose rank disagrees with ``r``.
    """
    from restorekit.formats import open as open_file

    path = os.fspath(path)
    directory = path if os.path.isdir(path) else os.path.dirname(path)
    config = read_config(os.path.join(directory, CONFIG_FILE))
    weights = os.path.join(directory, ADAPTER_FILE)
    if not os.path.isfile(weights):
        raise InvalidArgumentError(f"no {ADAPTER_FILE} in {directory!r} (a PEFT adapter saved with safetensors)")
    source = open_file(weights)
    source = source.stored_view() if hasattr(source, "stored_view") else source
    factors: dict = {}
    problems = []
    for key, entry in source.entries.items():
        m = _KEY.fullmatch(key)
        if m is None or len(entry.shape) != 2:
            why = "no LoRA factor of a Linear or Embedding" if m is None else \
                f"rank {len(entry.shape)}: LoRA of convolutions is not merged"
            problems.append((key, f"{key!r}: {why}"))
            continue
        module = m["module"].removeprefix(PREFIX)
        factors.setdefault(module, {})[m["ab"]] = (key, bool(m["kind"]), tuple(entry.shape))
    modules = {}
    for module, pair in factors.items():
        if set(pair) != {"A", "B"}:
            problems.append((module, f"{module!r}: lora_{'A' if 'A' in pair else 'B'} without its partner"))
            continue
        (a_key, embedding, a_shape), (b_key, _, b_shape) = pair["A"], pair["B"]
        r, _ = config.rank_and_scaling(module)
        if a_shape[0] != r or b_shape[1] != r:
            problems.append((module, f"{module!r}: lora_A {list(a_shape)}, lora_B {list(b_shape)} do not have "
                                     f"rank r={r} of {CONFIG_FILE}"))
            continue
        modules[module] = (a_key, b_key, embedding)
    if problems:
        raise SourceMismatchError(f"{weights!r} is not a LoRA adapter merge_lora merges; nothing was written", problems)
    if not modules:
        raise InvalidArgumentError(f"{weights!r} holds no LoRA factors")
    return Adapter(directory, config, source, modules)


# ------------------------------------------------------------------ pairing adapter modules with base entries
@dataclass(frozen=True)
class _Target:
    name: str  # the base entry
    shape: tuple  # the entry as the adapter's model holds it (torch axes)
    to_base: Callable  # an array of ``shape`` -> the entry's axes


def _same(array):
    return array


def _pairing(ckpt, layout: str | None, rules) -> dict:
    """``{name the adapter's model gives a weight: _Target}`` over the base's entries."""
    if layout is not None and rules is not None:
        raise InvalidArgumentError("pass layout='torch' or rules=, not both")
    if rules is not None:
        from restorekit.export._hf import TRANSFORMS, rule_set

        ruleset, out = rule_set(rules), {}
        for name, entry in ckpt.entries.items():
            new, transform, _ = ruleset.target_of(name)
            if new is None:
                continue
            if transform is None:
                out[new] = _Target(name, tuple(entry.shape), _same)
            elif TRANSFORMS[transform].shape(tuple(entry.shape)) is not None:
                undo = TRANSFORMS[TRANSFORMS[transform].inverse or transform].array
                out[new] = _Target(name, TRANSFORMS[transform].shape(tuple(entry.shape)), undo)
        return out
    if layout is not None:
        from restorekit.layouts import TorchView, check_layout

        check_layout(layout)
        view, out = TorchView(ckpt), {}
        for name, entry in view.entries.items():
            found = view.backward(name)
            if found is not None:
                out[name] = _Target(found[0], tuple(entry.shape), found[1])
        return out
    return {name: _Target(name, tuple(e.shape), _same) for name, e in ckpt.entries.items()}


def _plan(adapter: Adapter, ckpt, layout, rules) -> dict:
    """``{base entry: (module, scaling, fan_in_fan_out, _Target)}``, every module checked against the base."""
    pairing = _pairing(ckpt, layout, rules)
    plan, problems = {}, []
    for module, (a_key, b_key, embedding) in adapter.modules.items():
        target = pairing.get(f"{module}.weight")
        a_shape, b_shape = adapter.source.entries[a_key].shape, adapter.source.entries[b_key].shape
        transposed = embedding or adapter.config.fan_in_fan_out
        shape = (a_shape[1], b_shape[0]) if transposed else (b_shape[0], a_shape[1])
        if target is None:
            hint = "" if layout or rules else " (a TF or Keras base: pass layout='torch' or a rule set)"
            problems.append((module, f"{module + '.weight'!r}: no such weight in the base{hint}"))
        elif tuple(target.shape) != shape:
            problems.append((module, f"{module + '.weight'!r}: base {list(target.shape)}, adapter delta {list(shape)}"))
        else:
            _, scale = adapter.config.rank_and_scaling(module)
            plan[target.name] = (module, scale, transposed, target)
    if problems:
        raise SourceMismatchError("the adapter does not fit the base; nothing was written", problems,
                                  "Check that the adapter was trained on this base model.")
    return plan


# ------------------------------------------------------------------ merge
@dataclass(frozen=True)
class LoraMergeResult:
    """What ``merge_lora`` wrote: ``merged`` base entries (a delta added), ``copied`` ones as they were,
    ``dropped`` entries left out (Keras LoRA factors merged into their kernels, optimizer state)."""

    path: str
    format: str
    base: str
    adapter: str | None
    merged: tuple
    copied: int = 0
    dropped: tuple = ()
    nbytes: int = 0

    def __str__(self) -> str:
        lines = [f"restorekit: merged {self.adapter or 'the Keras LoRA weights'} into {self.base!r} -> "
                 f"{self.path!r} ({self.format})",
                 summary_row("merged", len(self.merged), format_names(self.merged)),
                 summary_row("copied", self.copied)]
        if self.dropped:
            lines.append(summary_row("dropped", len(self.dropped), format_names(self.dropped)))
        return "\n".join(lines)


def _keras_plan(ckpt, lora_alpha) -> tuple[dict, list]:
    """The Keras LoRA weights a checkpoint holds (``<layer>/lora_kernel_a``, ``_b`` beside ``<layer>/kernel``, by
    readable path): ``({kernel entry: (layer, scaling, (a entry, b entry))}, [the factor entries])``."""
    by_path = {ckpt.readable_name(n): n for n in ckpt.entries}
    plan, factors, problems = {}, [], []
    for path, a_name in by_path.items():
        scope, _, leaf = path.rpartition("/")
        if leaf != KERAS_LEAVES[0]:
            continue
        b_name, kernel = by_path.get(f"{scope}/{KERAS_LEAVES[1]}"), by_path.get(f"{scope}/kernel")
        a_shape = tuple(ckpt.entries[a_name].shape)
        if b_name is None or kernel is None:
            problems.append((scope, f"{scope!r}: {KERAS_LEAVES[0]} without {'its kernel' if b_name else KERAS_LEAVES[1]}"))
            continue
        b_shape, k_shape = tuple(ckpt.entries[b_name].shape), tuple(ckpt.entries[kernel].shape)
        if a_shape[:-1] + b_shape[1:] != k_shape or a_shape[-1] != b_shape[0]:
            problems.append((scope, f"{scope!r}: a {list(a_shape)} @ b {list(b_shape)} is not kernel {list(k_shape)}"))
            continue
        rank = a_shape[-1]
        plan[kernel] = (scope, scaling(rank, rank if lora_alpha is None else lora_alpha), (a_name, b_name))
        factors += [a_name, b_name]
    if problems:
        raise SourceMismatchError("the checkpoint's Keras LoRA weights do not fit their kernels; nothing was written",
                                  problems)
    if not plan:
        raise InvalidArgumentError(f"{ckpt.prefix!r} holds no Keras LoRA weights (lora_kernel_a / lora_kernel_b); "
                                   "pass the PEFT adapter to merge")
    return plan, factors


def keras_delta(a: np.ndarray, b: np.ndarray, scale: float) -> np.ndarray:
    """A Keras ``enable_lora`` layer's kernel delta, ``scale * (a @ b)``, through :func:`delta`:
    ``a`` ``[*in, r]`` flattened to ``[in, r]`` is PEFT's ``A.T``, ``b`` ``[r, out]`` its ``B.T``."""
    a2 = np.asarray(a).reshape(-1, np.shape(a)[-1])
    return delta(a2.T, np.asarray(b).T, scale, fan_in_fan_out=True).reshape(tuple(np.shape(a)[:-1]) + np.shape(b)[1:])


def merge_lora(base, adapter, out, *, to: str | None = None, layout: str | None = None, rules=None,
               lora_alpha: float | None = None, weights_only: bool = False, overwrite: bool = False,
               progress: bool = False) -> LoraMergeResult:
    """Merge a PEFT LoRA adapter into a base checkpoint, tensor by tensor, and write the merged weights.

    Each targeted weight becomes ``W + delta(A, B, scaling, fan_in_fan_out)`` (PEFT's
    ``merge_and_unload``), every other entry is copied. One base tensor is held at a time; the
    output appears whole or not at all (the format's writer commits it).

        merge_lora('hf-base/', 'lora-adapter/', 'merged/model.safetensors')
        merge_lora('tf/model.ckpt', 'lora-adapter/', 'merged/model.ckpt', layout='torch')
        merge_lora('run/ckpt-500', None, 'merged/model.ckpt')      # a Keras model's own LoRA weights

    Args:
        base: anything ``restorekit.formats.open`` opens: safetensors (a file, a Hugging Face shard
            directory), ``.pt``, ``.npz``, a TF checkpoint, a Keras file.
        adapter: a PEFT adapter directory (``adapter_model.safetensors``, ``adapter_config.json``
            with ``r``, ``lora_alpha``, ``target_modules``, ``fan_in_fan_out``, ``use_rslora``,
            ``rank_pattern``, ``alpha_pattern``); or None: merge the Keras ``lora_kernel_a`` /
            ``lora_kernel_b`` the base holds (a TF checkpoint of a model after ``enable_lora``) into
            their kernels and leave them out.
        out: the output; its format ``to`` or its extension, as ``convert`` decides it.
        to: the output format ('tf', 'safetensors', 'npz', 'torch').
        layout: 'torch' to pair the adapter's PyTorch names with a TF checkpoint's or Keras file's
            TF names and axes, as ``convert(layout='torch')`` maps them (a Dense kernel ``[in, out]``
            is ``nn.Linear``'s ``weight`` ``[out, in]``: the delta is transposed back).
        rules: a rule set (``'bert-tf-to-hf'``, ...), pairing the adapter's Hugging Face names with a
            TF checkpoint's as ``convert(rules=...)`` does.
        lora_alpha: with ``adapter=None``, the layers' ``lora_alpha`` (a checkpoint does not store it;
            default the rank, as Keras' ``enable_lora``).
        weights_only: leave out optimizer state, ``global_step`` and ``save_counter``.
        overwrite: replace an existing output.
        progress: a progress bar on stderr (when it is a terminal).

    Returns:
        A LoraMergeResult.

    Raises:
        InvalidArgumentError: a config merge_lora does not merge exactly, named (DoRA ``use_dora``,
            ``lora_bias``, ``modules_to_save``, biases, another PEFT type), both ``layout`` and ``rules``.
        SourceMismatchError: an adapter module with no base weight, or of another shape, or factors whose
            rank is not ``r`` (``problems`` lists them all).
        OptionNotApplicableError: ``lora_alpha`` with an adapter (its config has it).
        OutputExistsError: the output exists (without ``overwrite``) or is a source.

    Nothing is written when any of these is raised.
    """
    from restorekit._merging._pipeline import base_name, object_graph_kept, open_source as open_weights
    from restorekit._bundle.files import check_parent, check_space, output_prefix
    from restorekit.export._outputs import check_output
    from restorekit.export._targets import target_format
    from restorekit.formats import _sinks as formats
    from restorekit.formats.tf._writer import write_tf

    if adapter is not None and lora_alpha is not None:
        raise OptionNotApplicableError("lora_alpha", "a PEFT adapter", hint="its adapter_config.json holds lora_alpha")
    peft = read_adapter(adapter) if adapter is not None else None
    out = os.fspath(out)
    fmt = target_format(out, to)
    src = open_weights(os.fspath(base), bool(weights_only))
    if peft is not None and layout is None and rules is None and hasattr(src.ckpt, "stored_view"):
        src.ckpt = src.ckpt.stored_view()  # a restorekit export paired and written under the names it stores
        kept = set(src.names)
        src.names = [n for n in src.ckpt.entries if n in kept or not src.dropped]
    if fmt == formats.TF:
        out = output_prefix(out, base_name(src))
        check_parent(out)
    sources = src.files + ([os.path.join(peft.path, ADAPTER_FILE)] if peft is not None else [])
    check_output(out, fmt, sources, overwrite)
    if peft is not None:
        plan = {name: (module, scale, transposed, target.to_base, peft.modules[module][:2])
                for name, (module, scale, transposed, target) in _plan(peft, src.ckpt, layout, rules).items()}
        factors: list = []
    else:
        if layout is not None or rules is not None:
            raise InvalidArgumentError("layout= and rules= pair a PEFT adapter's names with the base; "
                                       "a Keras model's own LoRA weights need neither")
        keras, factors = _keras_plan(src.ckpt, lora_alpha)
        plan = {name: (scope, scale, None, None, pair) for name, (scope, scale, pair) in keras.items()}
    gone = set(factors)
    names = [n for n in src.names if n not in gone]
    entries = src.ckpt.entries
    nbytes = sum(entries[n].nbytes for n in names)
    check_space(os.path.dirname(os.path.abspath(out)), nbytes)
    graph = object_graph_kept(src, names)  # None without one; its keys of the factors left out removed

    def merged(name: str) -> np.ndarray:
        value = src.ckpt.read(name)
        _, scale, transposed, to_base, (a_name, b_name) = plan[name]
        if peft is None:
            change = keras_delta(src.ckpt.read(a_name), src.ckpt.read(b_name), scale)
        else:
            change = to_base(delta(peft.source.read(a_name), peft.source.read(b_name), scale, transposed))
        return (value.astype(np.float64) + change).astype(value.dtype)

    def tensors():
        for name in names:
            yield name, merged(name) if name in plan else src.ckpt.read(name), entries[name].dtype
        if graph is not None:
            from restorekit.export._options import OBJECT_GRAPH_KEY

            yield OBJECT_GRAPH_KEY, np.array(graph, dtype=object), "string"

    if fmt == formats.TF:
        write_tf(out, tensors(), total=nbytes, progress=progress)
    else:
        formats.module(fmt).write(out, tensors(), progress=progress)
    done = tuple(n for n in names if n in plan)
    return LoraMergeResult(out, fmt, src.path, peft.path if peft is not None else None, done, len(names) - len(done),
                       tuple(factors) + src.dropped, nbytes)


# ------------------------------------------------------------------ Keras LoRA out, as a PEFT adapter
@dataclass(frozen=True)
class LoraExportResult:
    """What ``export_lora_adapter`` wrote: the adapter directory, its files and ``{Keras layer: module}``."""

    path: str
    files: tuple
    modules: tuple  # ((Keras layer path, PEFT module name, r, lora_alpha), ...)

    def __str__(self) -> str:
        shown = format_names([f"{layer} -> {module} (r={r})" for layer, module, r, _ in self.modules])
        return f"restorekit: PEFT adapter {self.path!r}\n" + summary_row("modules", len(self.modules), shown)


def _lora_layers(model) -> list:
    """Every layer of ``model`` (itself and nested ones) with LoRA enabled, in order."""
    # Keras 3 has no public walk over nested layers; _flatten_layers is what Model.layers is built on.
    walk = model._flatten_layers(include_self=True) if hasattr(model, "_flatten_layers") else [model, *model.layers]
    return [layer for layer in walk if getattr(layer, "lora_enabled", False)]


def export_lora_adapter(model, out, *, names: dict | None = None, overwrite: bool = False) -> LoraExportResult:
    """Write the LoRA weights of a Keras model's ``enable_lora`` layers as a PEFT adapter directory.

    ``adapter_model.safetensors`` holds ``base_model.model.<module>.lora_A.weight`` (``lora_kernel_a.T``,
    ``[r, in]``) and ``lora_B.weight`` (``lora_kernel_b.T``, ``[out, r]``); ``adapter_config.json`` the
    rank and ``lora_alpha`` (``rank_pattern`` / ``alpha_pattern`` for layers that differ from the most
    common). Each module is named as ``convert(layout='torch')`` names the layer (the Keras path,
    ``/`` -> ``.``), so ``PeftModel.from_pretrained(torch_twin, out)`` loads it into the twin; ``names``
    renames layers (``{Keras layer path: module name}``). Both files appear in one commit.

        export_lora_adapter(model, 'lora-adapter/')

    Raises:
        InvalidArgumentError: no layer has LoRA enabled, a LoRA kernel that is not 2-D (an EinsumDense with
            several output axes: its delta is no LoRA pair of a torch ``Linear``), a ``names`` key naming no
            LoRA layer.
        OutputExistsError: the adapter files exist (without ``overwrite``).
    """
    from restorekit._bundle.files import check_parent
    from restorekit.errors import OutputExistsError
    from restorekit.formats.safetensors import _shards
    from restorekit.formats.safetensors._writer import write
    from restorekit.layouts import dotted

    layers = _lora_layers(model)
    if not layers:
        raise InvalidArgumentError("the model has no layer with LoRA enabled (layer.enable_lora(rank))")
    names = dict(names or {})
    rows, tensors, refused = [], [], []
    for layer in layers:
        a, b = (np.asarray(v.numpy() if hasattr(v, "numpy") else v) for v in (layer.lora_kernel_a, layer.lora_kernel_b))
        path = layer.lora_kernel_a.path.rpartition("/")[0]
        if a.ndim != 2 or b.ndim != 2:
            refused.append(f"{path!r}: lora_kernel_a {list(a.shape)} (a kernel with several input or output axes)")
            continue
        module = names.pop(path, None) or dotted(path)
        rows.append((path, module, int(layer.lora_rank), float(layer.lora_alpha)))
        tensors += [(f"{PREFIX}{module}.lora_A.weight", np.ascontiguousarray(a.T)),
                    (f"{PREFIX}{module}.lora_B.weight", np.ascontiguousarray(b.T))]
    if refused:
        raise InvalidArgumentError("LoRA layers PEFT has no Linear LoRA for (nothing was written):\n  " + "\n  ".join(refused))
    if names:
        raise InvalidArgumentError(f"names= keys name no LoRA layer: {format_names(list(names))}")
    out = os.fspath(out)
    weights, config_path = os.path.join(out, ADAPTER_FILE), os.path.join(out, CONFIG_FILE)
    check_parent(weights)
    existing = [p for p in (weights, config_path) if os.path.exists(p)]
    if existing and not overwrite:
        raise OutputExistsError(path=existing[0])
    r, alpha = Counter(row[2] for row in rows).most_common(1)[0][0], Counter(row[3] for row in rows).most_common(1)[0][0]
    config = {
        "peft_type": "LORA", "task_type": None, "base_model_name_or_path": None, "inference_mode": True,
        "r": r, "lora_alpha": alpha, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "init_lora_weights": True, "modules_to_save": None,
        "target_modules": sorted(module for _, module, _, _ in rows),
        "rank_pattern": {module: rank for _, module, rank, _ in rows if rank != r},
        "alpha_pattern": {module: a for _, module, _, a in rows if a != alpha},
    }
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    _shards.publish_file(weights, lambda tmp: write(tmp, iter(tensors), metadata={"format": "pt"}),
                         texts={config_path: text})
    return LoraExportResult(out, (weights, config_path), tuple(rows))
