"""What a conversion or a save is asked to do: the one table of which option applies to which format, checked once.

Every verb that writes another format (``convert``, ``export_checkpoint``,
``import_checkpoint``, ``CheckpointEditor.save``) asks :func:`check` of :data:`OPTIONS`
before anything is read or written, and refuses an option that does not apply with one
error, ``OptionNotApplicableError(option, format, applies_to)``. The verbs share one
vocabulary: ``out`` is the output, ``to`` the target format, ``max_shard_size`` the
largest shard of whatever the target is (TF data shards, safetensors shards, a Keras
sharded set); the older keyword names still work through :func:`renamed_keywords`, with
a ``DeprecationWarning``.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

from restorekit.errors import InvalidArgumentError, OptionNotApplicableError

__all__ = ["OPTIONS", "Applies", "Request", "check", "given", "renamed_keywords", "request"]

TF = "tf"
KERAS = "keras"  # a Keras 3 .weights.h5
KERAS_SHARDED = "keras-sharded"  # a Keras 3 sharded set, NAME.weights.json and its shards
KERAS_LEGACY = "keras-h5"  # a legacy Keras 2 .h5 (model or weights file), written from one
FILES = ("torch", "safetensors", "npz")


@dataclasses.dataclass(frozen=True)
class Applies:
    """Where one option applies: output formats (``targets``), and source formats that take it too (``sources``:
    an option that names one side's conventions, such as ``layout``, applies when either side has them)."""

    targets: tuple[str, ...]
    sources: tuple[str, ...] = ()
    hint: str = ""

    @property
    def applies_to(self) -> tuple[str, ...]:
        return self.targets + tuple(f"{s} sources" for s in self.sources if s not in self.targets)


OPTIONS: dict[str, Applies] = {
    "layout": Applies(("torch", "safetensors"), ("torch", "safetensors"),
                      "npz files and TF checkpoints keep TF names and axes; a Keras file keeps Keras' own"),
    "rules": Applies((TF, *FILES), hint="a .weights.h5 keeps Keras' own names"),
    "weights_only": Applies((TF, *FILES, KERAS, KERAS_SHARDED, KERAS_LEGACY)),
    "ema": Applies((TF, *FILES), hint="a .weights.h5 keeps Keras' own values"),
    "max_shard_size": Applies((TF, "safetensors", KERAS_SHARDED),
                              hint="name a Keras output '*.weights.json' for a sharded set; torch and npz files "
                                   "are written whole"),
    "num_shards": Applies((TF,), hint="{max_shard_size} splits the other formats that shard"),
    "config": Applies(FILES, hint="config.json goes beside a Hugging Face (torch, safetensors) output"),
    # layout='torch' hints (restorekit.layouts.torch_view): the layers' names and which Dense reads a Flatten.
    "model": Applies(("torch", "safetensors"), hint="model= tells layout='torch' the layers of a TF checkpoint"),
    "flatten_channels": Applies(("torch", "safetensors"), ("torch", "safetensors"),
                                hint="flatten_channels= reorders Dense inputs for layout='torch'"),
}


# What to say beside the table's own hint for an output that takes almost nothing. A hint names an option
# as ``{option}``: OptionNotApplicableError words it for Python (``option=``) or the shell (``--option``).
TARGET_HINTS: dict[str, str] = {
    KERAS: "A .weights.h5 keeps Keras' own names, layout and values: of the options it takes {weights_only} "
           "(and {overwrite}) only.",
    KERAS_LEGACY: "A legacy Keras .h5 keeps its source's layers, names, layout and values: of the options it takes "
                  "{weights_only} (and {overwrite}) only.",
}


def given(value) -> bool:
    """True when an option is set (None and False are its 'not given')."""
    return value is not None and value is not False


def check(options: dict, *, target: str, source: str | None = None) -> None:
    """Refuse the first given option of ``options`` ({keyword: value}) that applies to neither ``target`` nor ``source``.

        check({'num_shards': 2}, target='npz')   # OptionNotApplicableError('num_shards', 'npz', ('tf',))

    Raises:
        OptionNotApplicableError: with ``option``, ``format``, ``applies_to`` and ``value``.
    """
    for option, value in options.items():
        if not given(value):
            continue
        rule = OPTIONS[option]
        if target in rule.targets or (source is not None and source in rule.sources):
            continue
        raise OptionNotApplicableError(option, target, rule.applies_to, value=value,
                                       hint=" ".join(h for h in (rule.hint and rule.hint + ".",
                                                                 TARGET_HINTS.get(target)) if h),
                                       source=source if rule.sources else None)


@dataclasses.dataclass(frozen=True)
class Request:
    """What a conversion does besides changing format, its values checked (not yet against a format: :meth:`check`)."""

    layout: str | None = None
    rules: object = None
    weights_only: bool = False
    ema: object = None
    max_shard_size: object = None
    config: object = None
    num_shards: int | None = None
    model: object = None
    flatten_channels: dict | None = None

    @property
    def planned(self) -> bool:
        return self.rules is not None or self.weights_only or given(self.ema)

    def ruleset(self):
        from restorekit.export._hf import RuleSet, rule_set

        if isinstance(self.rules, (str, RuleSet)):
            return rule_set(self.rules)
        return None

    def options(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def check(self, target: str, source: str | None = None) -> None:
        """:func:`check` of every option against the target (and the source) format."""
        check(self.options(), target=target, source=source)

    @property
    def shard_limit(self) -> int | None:
        """``max_shard_size`` in bytes, or None."""
        from restorekit.formats.safetensors._shards import parse_size

        return None if self.max_shard_size is None else parse_size(self.max_shard_size)


def request(layout=None, rules=None, weights_only=False, ema=None, max_shard_size=None, config=None,
            num_shards=None, model=None, flatten_channels=None) -> Request:
    """The options of one conversion, each value checked on its own (formats are checked by ``Request.check``).

    Raises:
        InvalidArgumentError: an unknown layout or rule set, a layout a rule set overrides, ``config`` without a
            Hugging Face rule set, a bad ``max_shard_size`` or ``num_shards``, or both of those.
    """
    from restorekit._bundle.writer import check_num_shards
    from restorekit.layouts import check_layout
    from restorekit.formats.safetensors._shards import parse_size

    check_layout(layout)
    if num_shards is not None:
        num_shards = check_num_shards(num_shards)
    if max_shard_size is not None:
        parse_size(max_shard_size)
        if num_shards is not None:
            raise InvalidArgumentError("num_shards= and max_shard_size= both choose the shards: give one of them")
    if (model is not None or flatten_channels is not None) and layout != "torch":
        raise InvalidArgumentError("model= and flatten_channels= are hints of layout='torch': pass layout='torch' too")
    if flatten_channels is not None and not isinstance(flatten_channels, dict):
        raise InvalidArgumentError(f"flatten_channels= is a dict {{Dense layer: channels or None}}, got "
                                   f"{flatten_channels!r}")
    options = Request(layout, rules, bool(weights_only), ema, max_shard_size, config, num_shards, model,
                      flatten_channels)
    ruleset = options.ruleset()
    if ruleset is not None and layout is not None:
        if ruleset.target != "hf":
            raise InvalidArgumentError(f"rule set {ruleset.name!r} sets names and axes itself (TF's, not PyTorch's "
                                       f"as layout={layout!r} asks); leave layout=None")
        # The rule set writes Hugging Face (PyTorch) names and axes: exactly what layout='torch' asks for.
        options = dataclasses.replace(options, layout=None)
    if config and (ruleset is None or ruleset.model is None):
        raise InvalidArgumentError("config= writes a Hugging Face config.json: use it with rules='bert-tf-to-hf' "
                                   "or 'gpt2-tf-to-hf'")
    if config is not None and config is not True and config is not False and not isinstance(config, dict):
        raise InvalidArgumentError(f"config= is True or a dict of config.json values, got {config!r}")
    return options


def renamed_keywords(**old_names: str):
    """A decorator: the keyword ``old=`` still works as ``new=`` (``renamed_keywords(path='out')``), with a
    DeprecationWarning; both at once is an InvalidArgumentError."""

    def decorate(function):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            for old, new in old_names.items():
                if old in kwargs:
                    if new in kwargs:
                        raise InvalidArgumentError(f"{old}= is the old name of {new}=; pass {new}= only")
                    warnings.warn(f"{function.__qualname__}({old}=...) is deprecated; call it {new}=",
                                  DeprecationWarning, stacklevel=2)
                    kwargs[new] = kwargs.pop(old)
            return function(*args, **kwargs)

        return wrapper

    return decorate
