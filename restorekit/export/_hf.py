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

Each family is written once, as a table (``BERT_TABLE``, ``GPT2_TABLE``) of rows TF name,
HF name, transform, where ``{part}`` stands for a regex (a layer number, one of a few
words). :func:`table_rules` makes ``*-tf-to-hf`` of it; ``*-hf-to-tf`` is its
:meth:`RuleSet.inverse` (transforms undone: transpose <-> transpose, squeeze0 <->
unsqueeze0) plus the rows that only go one way, each with its reason: the dropped tied
copies and buffers, and the other spellings read (``aliases``).

Optimizer state (``adam_m``, ``adam_v``) and ``global_step`` are covered by no rule:
pass ``weights_only=True`` to leave them out.
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import numpy as np

from restorekit._bundle.format import empty_array
from restorekit.errors import InvalidArgumentError, NameCollisionError, RestoreKitWarning, Wording, format_names
from restorekit._names import invert_pair, is_weight

__all__ = ["RULE_SETS", "Rule", "RulePlan", "RuleSet", "TRANSFORMS", "Transform", "hf_config", "rule_set", "table_rules"]


# -- axis transforms
def _transpose_shape(shape):
    return tuple(reversed(shape)) if len(shape) == 2 else None


def _squeeze_shape(shape):
    return tuple(shape[1:]) if len(shape) >= 2 and shape[0] == 1 else None


def _unsqueeze_shape(shape):
    return (1, *shape)


class Transform(NamedTuple):
    """An axis transform: ``shape`` -> new shape (None when it does not apply), the array's, and its undoing."""

    shape: Callable
    array: Callable
    needs: str  # what a tensor must be for it to apply, for the error
    inverse: str | None  # the transform that undoes it; None: it loses data and nothing undoes it


def _transposed(array: np.ndarray) -> np.ndarray:
    """``array.T``, contiguous in fresh memory: copied a block of rows at a time, ~3x faster than numpy's own copy of
    a transposed array (which walks one of them a column at a time)."""
    if array.ndim != 2:
        return np.ascontiguousarray(array.T)
    out = empty_array(array.shape[::-1], array.dtype)
    for i in range(0, array.shape[0], 64):
        out[:, i : i + 64] = array[i : i + 64].T
    return out


TRANSFORMS = {
    "transpose": Transform(_transpose_shape, _transposed, "a rank-2 tensor", "transpose"),
    "squeeze0": Transform(_squeeze_shape, lambda a: a.reshape(a.shape[1:]), "a leading axis of 1", "unsqueeze0"),
    "unsqueeze0": Transform(_unsqueeze_shape, lambda a: a.reshape((1, *a.shape)), "", "squeeze0"),
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
        return array if transform is None else TRANSFORMS[transform].array(np.asarray(array))


@dataclass(frozen=True)
class RuleSet:
    """Names and axes from one convention to another; see the module docstring.

    The first rule whose pattern matches the whole name wins. Two kinds of one-directional
    rows sit beside the rules, each with its reason: ``aliases``, ``(pattern, replacement,
    why)`` rewrites of other spellings the source may use, applied in order before anything
    is matched (``BertModel``'s names without ``bert.``); and ``drop``, ``(pattern, why)``
    for names the target has no place for (a tied copy, a buffer). ``prepare`` and
    ``finish`` are functions rewriting a name before the rules and what a rule produced;
    :meth:`inverse` cannot undo a function, so the shipped sets use none.
    """

    name: str
    description: str
    rules: tuple
    drop: tuple = ()
    prepare: Callable | None = field(default=None, repr=False)
    finish: Callable | None = field(default=None, repr=False)
    target: str = "tf"  # the naming of the output: 'tf' or 'hf'
    model: str | None = None  # the Hugging Face model_type written by hf_config
    aliases: tuple = ()

    def _match(self, name: str) -> tuple[Rule | None, str | None, str | None]:
        """(the rule that takes ``name``, its target name, why dropped)."""
        prepared = self.prepare(name) if self.prepare else name
        for pattern, replacement, _ in self.aliases:
            m = re.fullmatch(pattern, prepared)
            if m:
                prepared = m.expand(replacement)
        for pattern, why in self.drop:
            if re.fullmatch(pattern, prepared):
                return None, None, why
        for rule in self.rules:
            m = re.fullmatch(rule.pattern, prepared)
            if m:
                new = m.expand(rule.replacement)
                return rule, self.finish(new) if self.finish else new, None
        return None, None, None

    def target_of(self, name: str) -> tuple[str | None, str | None, str | None]:
        """(target name, transform, why dropped) of one source name; (None, None, None) when no rule covers it."""
        rule, new, why = self._match(name)
        return new, None if rule is None else rule.transform, why

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
                reshaped = TRANSFORMS[transform].shape(shape)
                if reshaped is None:
                    raise InvalidArgumentError(
                        f"rule set {self.name!r}: {name!r} has shape {list(shape)}; its {transform} needs "
                        f"{TRANSFORMS[transform].needs}"
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

    def inverse(self, name: str | None = None, description: str | None = None, *, drop: tuple = (),
                aliases: tuple = (), target: str = "tf", model: str | None = None) -> "RuleSet":
        """The rule set that gives back what this one renamed: each rule's rewrite undone, in the same order,
        with its transform's inverse (transpose <-> transpose, squeeze0 <-> unsqueeze0).

        This set's own ``drop`` and ``aliases`` are one-directional and have no inverse: the
        target never holds a dropped name, nor the source's other spellings. ``drop`` and
        ``aliases`` here are the inverse's own (the target's tied copies and buffers, its
        other spellings). ``target`` and ``model`` are the inverse's output naming, as for any
        rule set. Whether each name comes back is checked over names by :meth:`check_inverse`.

        Raises:
            InvalidArgumentError: a rule that cannot be undone (it drops a captured group,
                matches text outside a group, or has a transform that loses data), or a
                ``prepare`` / ``finish`` function; the message names the rule and why.
            NameCollisionError: two rules write the same names, so the inverse cannot tell
                which to give back.
        """
        for option in ("prepare", "finish"):
            if getattr(self, option) is not None:
                raise InvalidArgumentError(f"rule set {self.name!r} has a {option} function, which cannot be "
                                           "inverted; state that rewrite as rules or aliases")
        rules: list[Rule] = []
        writers: dict[str, Rule] = {}
        for rule in self.rules:
            try:
                pattern, replacement = invert_pair(rule.pattern, rule.replacement, whole=True)
            except InvalidArgumentError as e:
                raise InvalidArgumentError(f"rule set {self.name!r}: {e}") from None
            transform = None
            if rule.transform is not None:
                transform = TRANSFORMS[rule.transform].inverse if rule.transform in TRANSFORMS else None
                if transform is None:
                    raise InvalidArgumentError(
                        f"rule set {self.name!r}: rule {rule.pattern!r} -> {rule.replacement!r} cannot be inverted: "
                        f"its transform {rule.transform!r} loses data (no transform undoes it)")
            if pattern in writers:
                raise NameCollisionError(
                    f"rule set {self.name!r}: rules {writers[pattern].pattern!r} and {rule.pattern!r} both write "
                    f"{rule.replacement!r}, so its inverse cannot tell which name to give back")
            writers[pattern] = rule
            rules.append(Rule(pattern, replacement, transform))
        return RuleSet(name or f"{self.name} (inverted)", description or f"the inverse of {self.name!r}",
                       tuple(rules), drop=drop, target=target, model=model, aliases=aliases)

    def check_inverse(self, shapes, inverse: "RuleSet | None" = None) -> None:
        """Check that every name of ``shapes`` comes back, with its shape, through this set and then ``inverse``.

        Args:
            shapes: ``{source name: shape}``, or source names alone (checked with shape
                ``[1, 2]``, which every transform takes).
            inverse: the set that should undo this one; by default :meth:`inverse`.

        Raises:
            InvalidArgumentError: names that come back as others, or not at all, each with the
                rule that carried it; and whatever :meth:`plan` or :meth:`inverse` raise.
        """
        shapes = {n: tuple(s) for n, s in shapes.items()} if isinstance(shapes, dict) else dict.fromkeys(shapes, (1, 2))
        inverse = self.inverse() if inverse is None else inverse
        forward = self.plan(shapes)
        lost = []
        for source, new in forward.names.items():
            back, transform, why = inverse.target_of(new)
            shape = forward.shapes[new]
            if transform is not None:
                shape = TRANSFORMS[transform].shape(shape)
            if back != source or shape != shapes[source]:
                rule = self._match(source)[0]
                assert rule is not None  # the forward plan mapped it
                came = (f"{back!r}" if back else why or "no rule") + (
                    f" with shape {list(shape) if shape else shape}" if shape != shapes[source] else "")
                lost.append(f"{source!r} -> {new!r} -> {came} (rule {rule.pattern!r} -> {rule.replacement!r})")
        if lost:
            shown = "; ".join(lost[:5]) + (f"; ... and {len(lost) - 5} more" if len(lost) > 5 else "")
            raise InvalidArgumentError(f"rule set {inverse.name!r} does not give back {len(lost)} name(s) "
                                       f"of {self.name!r}: {shown}")


def _uncovered_message(name: str, uncovered: list, w: Wording) -> str:
    text = f"rule set {name!r} has no rule for {format_names(uncovered)}"
    if any(not is_weight(n) for n in uncovered):
        text += (f"; optimizer state and global_step have no place in the target: pass {w.option('weights_only')} "
                 "to leave them out")
    return text


def table_rules(parts: dict, rows) -> tuple:
    """The rules TF -> HF of a family's table.

    Each row is ``(TF name, HF name[, transform])``, where ``{part}`` stands for the regex
    ``parts[part]``: captured on the TF side, written back on the HF side. The reverse
    direction is :meth:`RuleSet.inverse` of these rules.
    """
    rules = []
    for tf, hf, *transform in rows:
        tf_bits, hf_bits = re.split(r"\{(\w+)\}", tf), re.split(r"\{(\w+)\}", hf)
        captured = tf_bits[1::2]
        if sorted(captured) != sorted(hf_bits[1::2]) or len(set(captured)) != len(captured):
            raise ValueError(f"table row {tf!r} <-> {hf!r}: each part must appear once on each side")
        pattern = "".join(re.escape(b) if i % 2 == 0 else f"({parts[b]})" for i, b in enumerate(tf_bits))
        replacement = "".join(b.replace("\\", "\\\\") if i % 2 == 0 else f"\\g<{captured.index(b) + 1}>"
                              for i, b in enumerate(hf_bits))
        rules.append(Rule(pattern, replacement, *transform))
    return tuple(rules)


# -- BERT: the one table, TF name <-> HF name, transform (TF -> HF; HF -> TF undoes it)
BERT_PARTS = {"i": r"\d+", "table": "word|position|token_type", "qkv": "query|key|value", "io": "intermediate|output"}
BERT_TABLE = (
    ("bert/embeddings/{table}_embeddings", "bert.embeddings.{table}_embeddings.weight"),
    ("bert/embeddings/LayerNorm/gamma", "bert.embeddings.LayerNorm.weight"),
    ("bert/embeddings/LayerNorm/beta", "bert.embeddings.LayerNorm.bias"),
    ("bert/encoder/layer_{i}/attention/self/{qkv}/kernel", "bert.encoder.layer.{i}.attention.self.{qkv}.weight",
     "transpose"),
    ("bert/encoder/layer_{i}/attention/self/{qkv}/bias", "bert.encoder.layer.{i}.attention.self.{qkv}.bias"),
    ("bert/encoder/layer_{i}/attention/output/dense/kernel", "bert.encoder.layer.{i}.attention.output.dense.weight",
     "transpose"),
    ("bert/encoder/layer_{i}/attention/output/dense/bias", "bert.encoder.layer.{i}.attention.output.dense.bias"),
    ("bert/encoder/layer_{i}/attention/output/LayerNorm/gamma",
     "bert.encoder.layer.{i}.attention.output.LayerNorm.weight"),
    ("bert/encoder/layer_{i}/attention/output/LayerNorm/beta", "bert.encoder.layer.{i}.attention.output.LayerNorm.bias"),
    ("bert/encoder/layer_{i}/{io}/dense/kernel", "bert.encoder.layer.{i}.{io}.dense.weight", "transpose"),
    ("bert/encoder/layer_{i}/{io}/dense/bias", "bert.encoder.layer.{i}.{io}.dense.bias"),
    ("bert/encoder/layer_{i}/output/LayerNorm/gamma", "bert.encoder.layer.{i}.output.LayerNorm.weight"),
    ("bert/encoder/layer_{i}/output/LayerNorm/beta", "bert.encoder.layer.{i}.output.LayerNorm.bias"),
    ("bert/pooler/dense/kernel", "bert.pooler.dense.weight", "transpose"),
    ("bert/pooler/dense/bias", "bert.pooler.dense.bias"),
    ("cls/predictions/transform/dense/kernel", "cls.predictions.transform.dense.weight", "transpose"),
    ("cls/predictions/transform/dense/bias", "cls.predictions.transform.dense.bias"),
    ("cls/predictions/transform/LayerNorm/gamma", "cls.predictions.transform.LayerNorm.weight"),
    ("cls/predictions/transform/LayerNorm/beta", "cls.predictions.transform.LayerNorm.bias"),
    ("cls/predictions/output_bias", "cls.predictions.bias"),
    ("cls/seq_relationship/output_weights", "cls.seq_relationship.weight"),  # [2, hidden]: already [out, in]
    ("cls/seq_relationship/output_bias", "cls.seq_relationship.bias"),
    ("output_weights", "classifier.weight"),  # run_classifier.py's head: BertForSequenceClassification
    ("output_bias", "classifier.bias"),
)

BERT_TF_TO_HF = RuleSet(
    "bert-tf-to-hf",
    "google-research BERT TF1 checkpoint -> Hugging Face BertForPreTraining / BertModel",
    table_rules(BERT_PARTS, BERT_TABLE),
    target="hf",
    model="bert",
)

BERT_HF_TO_TF = BERT_TF_TO_HF.inverse(
    "bert-hf-to-tf",
    "Hugging Face BertForPreTraining / BertModel -> google-research BERT TF1 checkpoint names",
    aliases=((r"(?s)((?:embeddings|encoder|pooler)\..*)", r"bert.\1", "BertModel's names, without 'bert.'"),),
    drop=(
        (r"cls\.predictions\.decoder\.weight", "tied to bert.embeddings.word_embeddings.weight"),
        (r"cls\.predictions\.decoder\.bias", "tied to cls.predictions.bias"),
        (r"bert\.embeddings\.(?:position|token_type)_ids", "a buffer, not a weight"),
    ),
)


# -- GPT-2: the one table (Conv1D keeps [in, out]: its leading 1 is squeezed, nothing is transposed)
GPT2_PARTS = {"i": r"\d+", "embedding": "wte|wpe", "attn": "c_attn|c_proj", "mlp": "c_fc|c_proj", "ln": "ln_1|ln_2"}
GPT2_TABLE = (
    ("model/{embedding}", "{embedding}.weight"),
    ("model/h{i}/attn/{attn}/w", "h.{i}.attn.{attn}.weight", "squeeze0"),
    ("model/h{i}/attn/{attn}/b", "h.{i}.attn.{attn}.bias"),
    ("model/h{i}/mlp/{mlp}/w", "h.{i}.mlp.{mlp}.weight", "squeeze0"),
    ("model/h{i}/mlp/{mlp}/b", "h.{i}.mlp.{mlp}.bias"),
    ("model/h{i}/{ln}/g", "h.{i}.{ln}.weight"),
    ("model/h{i}/{ln}/b", "h.{i}.{ln}.bias"),
    ("model/ln_f/g", "ln_f.weight"),
    ("model/ln_f/b", "ln_f.bias"),
)

GPT2_TF_TO_HF = RuleSet(
    "gpt2-tf-to-hf",
    "OpenAI GPT-2 TF checkpoint -> Hugging Face GPT2Model / GPT2LMHeadModel",
    table_rules(GPT2_PARTS, GPT2_TABLE),
    target="hf",
    model="gpt2",
)

GPT2_HF_TO_TF = GPT2_TF_TO_HF.inverse(
    "gpt2-hf-to-tf",
    "Hugging Face GPT2Model / GPT2LMHeadModel -> OpenAI GPT-2 TF checkpoint names",
    aliases=((r"(?s)transformer\.(.*)", r"\1", "GPT2LMHeadModel's names, under 'transformer.'"),),
    drop=(
        (r"lm_head\.weight", "tied to wte.weight"),
        (r"h\.\d+\.attn\.(?:masked_)?bias", "a buffer (the causal mask), not a weight"),
    ),
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
