"""Named rule sets (names + axis transforms) between TF checkpoints and Hugging Face models, and their config.json.

A :class:`RuleSet` maps every name of a source to a name of the target, with the axis
transform the target expects, or drops it for a stated reason (a tied copy, a buffer).
A name no rule covers is an error, never silently carried along or left behind.
Four are registered (:func:`rule_set`), usable with ``convert(..., rules=NAME)``,
``CheckpointEditor.rename_all(NAME)`` and ``restorekit convert --rules NAME``:

``bert-tf-to-hf`` / ``bert-hf-to-tf``
    google-research BERT TF1 checkpoints <-> Hugging Face ``BertForPreTraining``
    (``bert.``-prefixed; ``BertModel`` loads the same file). Dense ``kernel`` [in, out]
    is transposed to ``weight`` [out, in]; ``LayerNorm/gamma``/``beta`` become
    ``weight``/``bias``; embedding tables and ``cls/seq_relationship/output_weights``
    ([2, hidden], already [out, in]) keep their axes; ``cls/predictions/output_bias``
    is ``cls.predictions.bias``. A fine-tuned ``run_classifier.py`` head
    (``output_weights``, ``output_bias``) is ``BertForSequenceClassification``'s
    ``classifier``. Back from HF, ``cls.predictions.decoder.weight``/``.bias`` (tied to
    the word embeddings and ``cls.predictions.bias``) and the ``position_ids`` /
    ``token_type_ids`` buffers are dropped; names without ``bert.`` (``BertModel``) are read too.
``gpt2-tf-to-hf`` / ``gpt2-hf-to-tf``
    OpenAI GPT-2 TF checkpoints (``model/h0/attn/c_attn/w`` [1, in, out]) <-> Hugging
    Face ``GPT2Model`` names (``GPT2LMHeadModel`` loads the same file; ``lm_head`` is
    tied to ``wte``). GPT-2's Conv1D keeps [in, out]: the leading 1 is squeezed, nothing
    is transposed; ``g``/``b`` are ``weight``/``bias``. Back from HF, ``lm_head.weight``
    (tied to ``wte``) and the ``attn.bias``/``attn.masked_bias`` buffers are dropped;
    ``transformer.``-prefixed names are read too.

Optimizer state (``adam_m``, ``adam_v``) and ``global_step`` are covered by no rule:
pass ``weights_only=True`` to leave them out.
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from restorekit.errors import InvalidArgumentError, NameCollisionError, RestoreKitWarning, Wording, format_names
from restorekit._names import is_weight

__all__ = ["RULE_SETS", "Rule", "RulePlan", "RuleSet", "hf_config", "rule_set"]


# -- axis transforms: name -> (shape -> new shape or None when it does not apply, array -> array)
def _transpose_shape(shape):
    return tuple(reversed(shape)) if len(shape) == 2 else None


def _squeeze_shape(shape):
    return tuple(shape[1:]) if len(shape) >= 2 and shape[0] == 1 else None


def _unsqueeze_shape(shape):
    return (1, *shape)


TRANSFORMS = {
    "transpose": (_transpose_shape, lambda a: np.ascontiguousarray(a.T), "a rank-2 tensor"),
    "squeeze0": (_squeeze_shape, lambda a: a.reshape(a.shape[1:]), "a leading axis of 1"),
    "unsqueeze0": (_unsqueeze_shape, lambda a: a.reshape((1, *a.shape)), ""),
}


@dataclass(frozen=True)
class Rule:
    """``pattern`` (matched whole, on the prepared name) -> ``replacement`` (``re`` template), then ``transform``."""

    pattern: str
    replacement: str
    transform: str | None = None


@dataclass(frozen=True)
class RulePlan:
    """A rule set applied to one checkpoint's names: what each becomes, and what is dropped."""

    names: dict  # source name -> target name, in source order
    transforms: dict  # source name -> transform name, for those transformed
    dropped: dict  # source name -> why
    shapes: dict  # target name -> shape

    def apply(self, name: str, array: np.ndarray) -> np.ndarray:
        """``array`` (the source tensor ``name``) in the target's axes."""
        transform = self.transforms.get(name)
        return array if transform is None else TRANSFORMS[transform][1](np.asarray(array))


@dataclass(frozen=True)
class RuleSet:
    """Names and axes from one convention to another; see the module docstring.

    ``prepare`` rewrites a source name before the rules are matched (optional prefixes,
    separators); ``finish`` rewrites what a rule produced (``/`` -> ``.``). The first
    rule whose pattern matches the whole prepared name wins. ``drop`` lists
    ``(pattern, why)`` for names the target has no place for.
    """

    name: str
    description: str
    rules: tuple
    drop: tuple = ()
    prepare: Callable = field(default=lambda n: n, repr=False)
    finish: Callable = field(default=lambda n: n, repr=False)
    target: str = "tf"  # the naming of the output: 'tf' or 'hf'
    model: str | None = None  # the Hugging Face model_type written by hf_config

    def target_of(self, name: str) -> tuple[str | None, str | None, str | None]:
        """(target name, transform, why dropped) of one source name; (None, None, None) when no rule covers it."""
        prepared = self.prepare(name)
        for pattern, why in self.drop:
            if re.fullmatch(pattern, prepared):
                return None, None, why
        for rule in self.rules:
            m = re.fullmatch(rule.pattern, prepared)
            if m:
                return self.finish(m.expand(rule.replacement)), rule.transform, None
        return None, None, None

    def plan(self, shapes: dict) -> RulePlan:
        """Apply the rule set to ``{source name: shape}``, checking everything before anything is written.

        Raises:
            InvalidArgumentError: a name no rule covers, or a tensor whose shape its transform cannot take.
            NameCollisionError: two names land on one.
        """
        names, transforms, dropped, out_shapes, uncovered = {}, {}, {}, {}, []
        owners: dict[str, str] = {}
        for name, shape in shapes.items():
            new, transform, why = self.target_of(name)
            if why is not None:
                dropped[name] = why
                continue
            if new is None:
                uncovered.append(name)
                continue
            shape = tuple(shape)
            if transform is not None:
                reshaped = TRANSFORMS[transform][0](shape)
                if reshaped is None:
                    raise InvalidArgumentError(
                        f"rule set {self.name!r}: {name!r} has shape {list(shape)}; its {transform} needs "
                        f"{TRANSFORMS[transform][2]}"
                    )
                shape = reshaped
                transforms[name] = transform
            if new in owners:
                raise NameCollisionError(f"rule set {self.name!r} maps both {owners[new]!r} and {name!r} to {new!r}")
            owners[new] = name
            names[name] = new
            out_shapes[new] = shape
        if uncovered:
            raise InvalidArgumentError.worded(lambda w: _uncovered_message(self.name, uncovered, w))
        if not names:
            raise InvalidArgumentError(f"rule set {self.name!r} covers no tensor of this checkpoint")
        return RulePlan(names, transforms, dropped, out_shapes)


def _uncovered_message(name: str, uncovered: list, w: Wording) -> str:
    text = f"rule set {name!r} has no rule for {format_names(uncovered)}"
    if any(not is_weight(n) for n in uncovered):
        text += (f"; optimizer state and global_step have no place in the target: pass {w.option('weights_only')} "
                 "to leave them out")
    return text


# -- BERT
_BERT_DENSE = (r"bert/encoder/layer_\d+/attention/self/(?:query|key|value)|bert/encoder/layer_\d+/attention/output/dense"
               r"|bert/encoder/layer_\d+/(?:intermediate|output)/dense|bert/pooler/dense|cls/predictions/transform/dense")
_BERT_NORM = (r"bert/embeddings/LayerNorm|bert/encoder/layer_\d+/(?:attention/output|output)/LayerNorm"
              r"|cls/predictions/transform/LayerNorm")
_BERT_TABLES = r"bert/embeddings/(?:word|position|token_type)_embeddings"


def _bert_hf(name: str) -> str:
    """'bert/encoder/layer_3/output/dense/weight' -> 'bert.encoder.layer.3.output.dense.weight'."""
    return re.sub(r"(^|/)layer_(\d+)(?=/)", r"\1layer/\2", name).replace("/", ".")


def _bert_tf(name: str) -> str:
    """The inverse of ``_bert_hf``; names of ``BertModel`` (no ``bert.``) get the prefix."""
    if re.match(r"(?:embeddings|encoder|pooler)\.", name):
        name = "bert." + name
    return re.sub(r"(^|/)layer/(\d+)(?=/)", r"\1layer_\2", name.replace(".", "/"))


BERT_TF_TO_HF = RuleSet(
    "bert-tf-to-hf",
    "google-research BERT TF1 checkpoint -> Hugging Face BertForPreTraining / BertModel",
    (
        Rule(rf"({_BERT_TABLES})", r"\1/weight"),
        Rule(rf"({_BERT_DENSE})/kernel", r"\1/weight", "transpose"),
        Rule(rf"({_BERT_DENSE})/bias", r"\1/bias"),
        Rule(rf"({_BERT_NORM})/gamma", r"\1/weight"),
        Rule(rf"({_BERT_NORM})/beta", r"\1/bias"),
        Rule(r"cls/predictions/output_bias", "cls/predictions/bias"),
        Rule(r"cls/seq_relationship/output_weights", "cls/seq_relationship/weight"),
        Rule(r"cls/seq_relationship/output_bias", "cls/seq_relationship/bias"),
        Rule(r"output_weights", "classifier/weight"),
        Rule(r"output_bias", "classifier/bias"),
    ),
    finish=_bert_hf,
    target="hf",
    model="bert",
)

BERT_HF_TO_TF = RuleSet(
    "bert-hf-to-tf",
    "Hugging Face BertForPreTraining / BertModel -> google-research BERT TF1 checkpoint names",
    (
        Rule(rf"({_BERT_TABLES})/weight", r"\1"),
        Rule(rf"({_BERT_DENSE})/weight", r"\1/kernel", "transpose"),
        Rule(rf"({_BERT_DENSE})/bias", r"\1/bias"),
        Rule(rf"({_BERT_NORM})/weight", r"\1/gamma"),
        Rule(rf"({_BERT_NORM})/bias", r"\1/beta"),
        Rule(r"cls/predictions/bias", "cls/predictions/output_bias"),
        Rule(r"cls/seq_relationship/weight", "cls/seq_relationship/output_weights"),
        Rule(r"cls/seq_relationship/bias", "cls/seq_relationship/output_bias"),
        Rule(r"classifier/weight", "output_weights"),
        Rule(r"classifier/bias", "output_bias"),
    ),
    drop=(
        (r"cls/predictions/decoder/weight", "tied to bert.embeddings.word_embeddings.weight"),
        (r"cls/predictions/decoder/bias", "tied to cls.predictions.bias"),
        (r"bert/embeddings/(?:position|token_type)_ids", "a buffer, not a weight"),
    ),
    prepare=_bert_tf,
)


# -- GPT-2
_GPT2_CONV = r"model/h\d+/(?:attn/c_attn|attn/c_proj|mlp/c_fc|mlp/c_proj)"
_GPT2_NORM = r"model/h\d+/ln_[12]|model/ln_f"


def _gpt2_hf(name: str) -> str:
    """'model/h3/attn/c_attn/weight' -> 'h.3.attn.c_attn.weight'."""
    return re.sub(r"^model/h(\d+)/", r"h/\1/", name).removeprefix("model/").replace("/", ".")


def _gpt2_tf(name: str) -> str:
    """The inverse of ``_gpt2_hf``; ``GPT2LMHeadModel`` names (``transformer.``) are read too."""
    name = name.removeprefix("transformer.")
    if name == "lm_head.weight":
        return name
    return "model/" + re.sub(r"^h\.(\d+)\.", r"h\1.", name).replace(".", "/")


GPT2_TF_TO_HF = RuleSet(
    "gpt2-tf-to-hf",
    "OpenAI GPT-2 TF checkpoint -> Hugging Face GPT2Model / GPT2LMHeadModel",
    (
        Rule(r"model/(wte|wpe)", r"model/\1/weight"),
        Rule(rf"({_GPT2_CONV})/w", r"\1/weight", "squeeze0"),
        Rule(rf"({_GPT2_CONV})/b", r"\1/bias"),
        Rule(rf"({_GPT2_NORM})/g", r"\1/weight"),
        Rule(rf"({_GPT2_NORM})/b", r"\1/bias"),
    ),
    finish=_gpt2_hf,
    target="hf",
    model="gpt2",
)

GPT2_HF_TO_TF = RuleSet(
    "gpt2-hf-to-tf",
    "Hugging Face GPT2Model / GPT2LMHeadModel -> OpenAI GPT-2 TF checkpoint names",
    (
        Rule(r"model/(wte|wpe)/weight", r"model/\1"),
        Rule(rf"({_GPT2_CONV})/weight", r"\1/w", "unsqueeze0"),
        Rule(rf"({_GPT2_CONV})/bias", r"\1/b"),
        Rule(rf"({_GPT2_NORM})/weight", r"\1/g"),
        Rule(rf"({_GPT2_NORM})/bias", r"\1/b"),
    ),
    drop=(
        (r"lm_head\.weight", "tied to wte.weight"),
        (r"model/h\d+/attn/(?:masked_)?bias", "a buffer (the causal mask), not a weight"),
    ),
    prepare=_gpt2_tf,
)

RULE_SETS = {r.name: r for r in (BERT_TF_TO_HF, BERT_HF_TO_TF, GPT2_TF_TO_HF, GPT2_HF_TO_TF)}


def rule_set(rules) -> RuleSet:
    """The registered rule set named ``rules`` (a RuleSet is returned as is).

    Raises:
        InvalidArgumentError: no rule set has that name.
    """
    if isinstance(rules, RuleSet):
        return rules
    try:
        return RULE_SETS[rules]
    except (KeyError, TypeError):
        raise InvalidArgumentError(f"unknown rule set {rules!r}; choose one of {', '.join(RULE_SETS)}") from None


# -- config.json
def hf_config(rules: RuleSet, shapes: dict, overrides: dict | None = None) -> dict:
    """A Hugging Face ``config.json`` (as a dict) for the converted tensors ``{HF name: shape}``.

    Sizes are read from the shapes. The number of attention heads cannot be: pass it in
    ``overrides`` (``{'num_attention_heads': 12}``, GPT-2: ``{'n_head': 12}``), else the
    conventional 64-wide heads are assumed (hidden size / 64) and a RestoreKitWarning says so.

    Raises:
        InvalidArgumentError: the rule set does not produce a Hugging Face model, a size
            cannot be read, or the hidden size does not split into 64-wide heads.
    """
    if rules.model == "bert":
        config = _bert_config(shapes)
        heads_key, hidden = "num_attention_heads", config["hidden_size"]
    elif rules.model == "gpt2":
        config = _gpt2_config(shapes)
        heads_key, hidden = "n_head", config["n_embd"]
    else:
        raise InvalidArgumentError(f"rule set {rules.name!r} writes TF names; config.json is for Hugging Face outputs")
    overrides = dict(overrides or {})
    if heads_key not in overrides:
        if hidden % 64:
            raise InvalidArgumentError(
                f"hidden size {hidden} is not a multiple of 64, so the number of attention heads cannot be assumed; "
                f"pass it (config={{{heads_key!r}: N}}, or --heads N)"
            )
        warnings.warn(
            f"config.json: {heads_key}={hidden // 64} assumed (hidden size {hidden} / 64-wide heads); the number of "
            f"heads cannot be read from the shapes: pass {heads_key} (--heads) if the model differs",
            RestoreKitWarning,
            stacklevel=3,
        )
        overrides[heads_key] = hidden // 64
    config.update(overrides)
    return config


def _shape(shapes: dict, name: str, where: str) -> tuple:
    for prefix in ("", "bert.", "transformer."):
        if prefix + name in shapes:
            return tuple(shapes[prefix + name])
    raise InvalidArgumentError(f"config.json needs {name!r} ({where}), which the converted tensors lack")


def _layers(shapes: dict, pattern: str) -> int:
    found = {int(m.group(1)) for n in shapes for m in [re.search(pattern, n)] if m}
    if not found:
        raise InvalidArgumentError("config.json: the converted tensors hold no layers")
    return max(found) + 1


def _bert_config(shapes: dict) -> dict:
    vocab, hidden = _shape(shapes, "embeddings.word_embeddings.weight", "vocab and hidden size")
    head = any(n.startswith("cls.") for n in shapes)
    classifier = "classifier.weight" in shapes
    config = {
        "architectures": ["BertForPreTraining" if head else "BertForSequenceClassification" if classifier else "BertModel"],
        "model_type": "bert",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": _layers(shapes, r"encoder\.layer\.(\d+)\."),
        "intermediate_size": _shape(shapes, "encoder.layer.0.intermediate.dense.weight", "intermediate size")[0],
        "max_position_embeddings": _shape(shapes, "embeddings.position_embeddings.weight", "max positions")[0],
        "type_vocab_size": _shape(shapes, "embeddings.token_type_embeddings.weight", "type vocabulary")[0],
        "hidden_act": "gelu",
        "layer_norm_eps": 1e-12,
    }
    if classifier:
        config["num_labels"] = shapes["classifier.weight"][0]
    return config


def _gpt2_config(shapes: dict) -> dict:
    vocab, hidden = _shape(shapes, "wte.weight", "vocab and hidden size")
    inner = _shape(shapes, "h.0.mlp.c_fc.weight", "inner size")[1]
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": vocab,
        "n_embd": hidden,
        "n_layer": _layers(shapes, r"(?:^|\.)h\.(\d+)\."),
        "n_positions": _shape(shapes, "wpe.weight", "max positions")[0],
        "n_inner": None if inner == 4 * hidden else inner,
        "bos_token_id": vocab - 1,  # GPT-2's <|endoftext|> is the last token
        "eos_token_id": vocab - 1,
    }


def config_text(config: dict) -> str:
    return json.dumps(config, indent=2, sort_keys=True) + "\n"
