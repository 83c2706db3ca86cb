"""Plan-time policies of a partial restore: shape policies, dtype casts, vocabulary remaps.

Pure checks and decisions that ``scan`` records in a report; the TF ops that apply
them live in ``restorekit._remap``.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable
from dataclasses import dataclass, field

import numpy as np

from restorekit.errors import InvalidArgumentError, NoMatchError, VocabularyError
from restorekit._names import PatternSet
from restorekit._report import format_shape, policy_of

__all__ = [
    "ADAPT_INPUT_CHANNELS",
    "CAST",
    "RESIZE_POSITIONS",
    "SKIP",
    "SLICE_OR_PAD",
    "AdaptInputChannels",
    "ResizePositions",
    "ShapeAdapter",
    "ShapePolicies",
    "VocabRemap",
    "check_dtype_policy",
    "check_vocab",
    "dtype_cast_applies",
    "has_policy",
    "policy_applies",
    "policy_name",
    "policy_reason",
    "resolve_shape_policy",
]

SKIP = "skip"
SLICE_OR_PAD = "slice_or_pad"
# scan(dtype_policy='cast'): a float entry restores into a float variable of another
# precision (a bfloat16 checkpoint into a float32 model), cast by TF on the way in.
CAST = "cast"
_FLOAT_NAMES = frozenset({"float16", "bfloat16", "float32", "float64"})
RESIZE_POSITIONS = "resize_positions"
ADAPT_INPUT_CHANNELS = "adapt_input_channels"
_NAMED = (SKIP, SLICE_OR_PAD, RESIZE_POSITIONS, ADAPT_INPUT_CHANNELS)


# ------------------------------------------------------------------ vocabularies

def _read_words(vocab, what: str) -> tuple[str, ...]:
    if isinstance(vocab, (list, tuple)):
        words = [w.decode() if isinstance(w, bytes) else str(w) for w in vocab]
        source = f"{what} list"
    elif isinstance(vocab, (str, bytes)) or hasattr(vocab, "__fspath__"):
        from restorekit._bundle import files

        path = str(vocab)
        if not files.exists(path):
            raise VocabularyError(f"{what} file {path!r} does not exist")
        words = files.read_bytes(path).decode("utf-8").splitlines()
        source = f"{what} file {path!r}"
    else:
        raise VocabularyError(f"{what} is a file path or a list of words, got {type(vocab).__name__}: {vocab!r}")
    first: dict[str, int] = {}
    for i, word in enumerate(words):
        if word in first:
            raise VocabularyError(
                f"{source} lists {word!r} twice (entries {first[word]} and {i}); a vocabulary maps each word to one row"
            )
        first[word] = i
    return tuple(words)


@dataclass(frozen=True, eq=False)
class VocabRemap:
    """Restore an embedding or output layer whose vocabulary changed (``warm_start``'s ``VocabInfo``).

    Row (``axis=0``) or column (``axis=1``) ``i`` of the new variable takes the
    checkpoint's row for ``new_vocab[i]`` in ``old_vocab``; words not in the old
    vocabulary, and the ``num_oov_buckets`` rows after the vocabulary, come from
    ``backup_initializer`` (zeros when None), as in ``tf.compat.v1.train.warm_start``.

    Args:
        old_vocab: the checkpoint's vocabulary: a file (one word per line) or a list.
        new_vocab: the model's vocabulary, likewise.
        axis: 0 to remap rows (embeddings), 1 to remap columns (an output layer).
        old_vocab_size: use only the first ``old_vocab_size`` old words (None: all).
        num_oov_buckets: out-of-vocabulary rows after the new vocabulary.
        backup_initializer: ``init(shape, dtype=...)`` for rows with no old value.

    Example:
        >>> vocab = {'emb/embeddings': restorekit.VocabRemap('old.txt', 'new.txt')}
        >>> restorekit.restore(restorekit.scan('ckpt/', model, vocab=vocab))
    """

    old_vocab: object
    new_vocab: object
    axis: int = 0
    old_vocab_size: int | None = None
    num_oov_buckets: int = 0
    backup_initializer: Callable[..., Any] | None = None
    _words: list = field(default_factory=list, init=False, repr=False)

    def __post_init__(self):
        for what in ("axis", "num_oov_buckets", "old_vocab_size"):
            value = getattr(self, what)
            if not (value is None and what == "old_vocab_size") and (
                isinstance(value, bool) or not isinstance(value, numbers.Integral)
            ):
                raise InvalidArgumentError(f"VocabRemap {what} must be an int, got {value!r}")
        if self.axis not in (0, 1):
            raise InvalidArgumentError(f"VocabRemap axis is 0 (rows) or 1 (columns), got {self.axis!r}")
        if self.num_oov_buckets < 0:
            raise InvalidArgumentError(f"num_oov_buckets must be >= 0, got {self.num_oov_buckets}")
        if self.old_vocab_size is not None and self.old_vocab_size < 0:
            raise InvalidArgumentError(f"old_vocab_size must be >= 0, got {self.old_vocab_size}")
        if self.backup_initializer is not None and not callable(self.backup_initializer):
            raise InvalidArgumentError(f"backup_initializer must be callable, got {self.backup_initializer!r}")
        # Word lists are checked now (a duplicate makes the remap ambiguous); files when first read.
        for vocab, what in ((self.old_vocab, "old vocabulary"), (self.new_vocab, "new vocabulary")):
            if isinstance(vocab, (list, tuple)):
                _read_words(vocab, what)

    def words(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(old words in use, new words), read once.

        Raises:
            VocabularyError: a file is missing, lists a word twice, or is shorter
                than ``old_vocab_size``.
        """
        if not self._words:
            old = _read_words(self.old_vocab, "old vocabulary")
            new = _read_words(self.new_vocab, "new vocabulary")
            if self.old_vocab_size is not None:
                if self.old_vocab_size > len(old):
                    raise VocabularyError(
                        f"old_vocab_size={self.old_vocab_size} but the old vocabulary has only {len(old)} words"
                    )
                old = old[: self.old_vocab_size]
            self._words.extend([old, new])
        return self._words[0], self._words[1]

    def index(self) -> np.ndarray:
        """For each new row (vocabulary, then OOV buckets): its old row, or -1."""
        old, new = self.words()
        position = {w: i for i, w in enumerate(old)}
        rows = [position.get(w, -1) for w in new] + [-1] * self.num_oov_buckets
        return np.asarray(rows, dtype=np.int64)

    def check(self, variable_name: str, shape, checkpoint_shape) -> int:
        """Check that this remap fits the variable and checkpoint entry; return rows found in the old vocabulary.

        Raises:
            VocabularyError: the shapes do not fit the vocabularies.
        """
        old, new = self.words()
        axis = self.axis
        if shape is None or len(shape) <= axis or len(checkpoint_shape) != len(shape):
            raise VocabularyError(
                f"{variable_name!r}: cannot remap axis {axis} of a {format_shape(shape or ())} variable from a "
                f"{format_shape(checkpoint_shape)} checkpoint entry"
            )
        rows = len(new) + self.num_oov_buckets
        if shape[axis] is not None and shape[axis] != rows:
            raise VocabularyError(
                f"{variable_name!r} has {shape[axis]} entries along axis {axis}, but the new vocabulary has "
                f"{len(new)} words + {self.num_oov_buckets} OOV buckets = {rows}"
            )
        if checkpoint_shape[axis] < len(old):
            raise VocabularyError(
                f"{variable_name!r}: the checkpoint entry has {checkpoint_shape[axis]} entries along axis {axis}, "
                f"fewer than the {len(old)} old vocabulary words; pass old_vocab_size={checkpoint_shape[axis]}"
            )
        for d, (m, c) in enumerate(zip(shape, checkpoint_shape)):
            if d != axis and m is not None and m != c:
                raise VocabularyError(
                    f"{variable_name!r}: checkpoint {format_shape(checkpoint_shape)} and model {format_shape(shape)} differ on "
                    f"axis {d}, which the vocabulary does not cover"
                )
        return int((self.index() >= 0).sum())


# ------------------------------------------------------------------ shape policies

class ShapePolicies:
    """A ``shape_policy`` argument, resolved: which policy applies to a variable name."""

    def __init__(self, shape_policy):
        self.default = SKIP
        self.patterns = PatternSet(None, what="shape_policy pattern")
        self.by_pattern: list = []
        if shape_policy is None:
            return
        if isinstance(shape_policy, dict):
            self.patterns = PatternSet(list(shape_policy), what="shape_policy pattern")
            self.by_pattern = [_check_policy(policy) for policy in shape_policy.values()]
        else:
            self.default = _check_policy(shape_policy)

    def __bool__(self) -> bool:
        return self.default != SKIP or bool(self.by_pattern)

    def for_name(self, name: str):
        """The policy for ``name``: 'skip', 'slice_or_pad', a ShapeAdapter or a callable."""
        if self.by_pattern:
            pattern = self.patterns.first_match(name)
            if pattern is not None:
                return self.by_pattern[self.patterns.patterns.index(pattern)]
        return self.default

    def check_all_used(self, names) -> None:
        self.patterns.check_all_used(names)


def _check_policy(policy):
    if isinstance(policy, ShapeAdapter):
        return policy
    if isinstance(policy, str) and policy in _ADAPTERS:
        return _ADAPTERS[policy]()  # the adapter with its defaults
    if callable(policy) or (isinstance(policy, str) and policy in _NAMED):
        return policy
    raise InvalidArgumentError(
        f"a shape policy is 'skip', 'slice_or_pad', 'resize_positions', 'adapt_input_channels', a "
        f"ResizePositions(...) or AdaptInputChannels(...), a callable (checkpoint_value, variable) -> value "
        f"or a dict {{pattern: policy}}; got {policy!r}"
    )


def resolve_shape_policy(shape_policy) -> ShapePolicies:
    """Validate a ``scan(..., shape_policy=...)`` argument.

    Raises:
        InvalidArgumentError: not a policy, a callable or a dict of them.
    """
    return ShapePolicies(shape_policy)


def policy_applies(policy, shape, checkpoint_shape) -> bool:
    """True when ``policy`` can restore a ``checkpoint_shape`` entry into a ``shape`` variable."""
    if isinstance(policy, ShapeAdapter):
        return policy.applies(shape, checkpoint_shape)
    if policy == SKIP:
        return False
    if policy == SLICE_OR_PAD:
        return shape is not None and None not in shape and len(shape) == len(checkpoint_shape)
    return True


def dtype_cast_applies(dtype_policy, dtype: str, checkpoint_dtype: str | None) -> bool:
    """True when ``scan(dtype_policy=...)`` lets a ``checkpoint_dtype`` entry restore into a ``dtype`` variable."""
    return dtype_policy == CAST and dtype in _FLOAT_NAMES and checkpoint_dtype in _FLOAT_NAMES


def check_dtype_policy(dtype_policy) -> None:
    if dtype_policy not in (None, CAST):
        raise InvalidArgumentError(f"dtype_policy is None or 'cast', got {dtype_policy!r}")


def policy_reason(policy) -> str:
    """The ``Record.reason`` of a record restored through ``policy``."""
    if isinstance(policy, VocabRemap):
        return "vocab"
    if isinstance(policy, ShapeAdapter):
        return policy.name
    if policy == SLICE_OR_PAD:
        return SLICE_OR_PAD
    return f"shape_policy: {getattr(policy, '__name__', type(policy).__name__)}"


def has_policy(report, record) -> bool:
    """True when ``record`` is restored through a shape policy or VocabRemap (not a plain copy).

    Such records cannot go through a Saver; ``tf1_initializer`` or
    ``restorekit.restore`` handles them.
    """
    return policy_of(report, record.variable_name) is not None


def policy_name(policy) -> str:
    if isinstance(policy, ShapeAdapter):
        return policy.name
    return getattr(policy, "__name__", None) or type(policy).__name__


def check_vocab(vocab, names) -> dict:
    """Validate ``scan(..., vocab=...)``: a dict variable name -> VocabRemap, every name known.

    Raises:
        InvalidArgumentError: not a dict of VocabRemap.
        NoMatchError: a key names no variable being scanned.
        VocabularyError: a vocabulary cannot be read.
    """
    if vocab is None:
        return {}
    if not isinstance(vocab, dict):
        raise InvalidArgumentError(f"vocab is a dict {{variable_name: VocabRemap}}, got {type(vocab).__name__}")
    names = list(names)
    known = set(names)
    for name, remap in vocab.items():
        if not isinstance(remap, VocabRemap):
            raise InvalidArgumentError(f"vocab[{name!r}] must be a restorekit.VocabRemap, got {remap!r}")
        if name not in known:
            raise NoMatchError(f"vocab key {name!r} is not a variable being scanned.", name=name, candidates=names)
        remap.words()
    return dict(vocab)


# ------------------------------------------------------------------ shape adapters

class ShapeAdapter:
    """A named shape policy that computes a checkpoint value's new shape in numpy (no TF at plan time).

    ``applies(shape, checkpoint_shape)`` decides at scan time; ``adapt(value, shape)``
    computes the restored value, on restore, in TF1 initializers and eagerly alike.
    """

    name = ""

    def applies(self, shape, checkpoint_shape) -> bool:
        raise NotImplementedError

    def adapt(self, value: np.ndarray, shape) -> np.ndarray:
        raise NotImplementedError


_METHODS = {"linear": "linear", "bilinear": "linear", "cubic": "cubic", "bicubic": "cubic"}


def _keys_cubic(x: np.ndarray, a: float = -0.5) -> np.ndarray:
    x = np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x <= 1, near, np.where(x < 2, far, 0.0))


def resize_matrix(old: int, new: int, method: str = "linear") -> np.ndarray:
    """The [new, old] float64 matrix that resamples a length-``old`` axis to ``new`` points.

    Half-pixel centres (output point ``i`` samples input coordinate ``(i + 0.5) * old / new - 0.5``),
    no antialiasing, taps outside the input dropped and the rest renormalized: the convention of
    ``tf.image.resize`` (bilinear: a triangle kernel; bicubic: Keys' kernel with a = -0.5).
    """
    centre = (np.arange(new, dtype=np.float64) + 0.5) * (old / new) - 0.5
    base = np.floor(centre).astype(np.int64)
    taps = (0, 1) if method == "linear" else (-1, 0, 1, 2)
    matrix = np.zeros((new, old), np.float64)
    for tap in taps:
        index = base + tap
        distance = centre - index
        weight = np.maximum(0.0, 1.0 - np.abs(distance)) if method == "linear" else _keys_cubic(distance)
        inside = (index >= 0) & (index < old)
        np.add.at(matrix, (np.arange(new)[inside], index[inside]), weight[inside])
    return matrix / matrix.sum(axis=1, keepdims=True)


def _square_side(n: int) -> int | None:
    side = int(round(np.sqrt(n))) if n > 0 else 0
    return side if side * side == n else None


@dataclass(frozen=True)
class ResizePositions(ShapeAdapter):
    """Resize a learned position-embedding table to a new sequence length or image grid.

    The table's positions run along its second-to-last axis (``[N, D]`` as BERT stores
    them, ``[1, N, D]`` as ViT does); every other axis must agree. The first
    ``num_prefix_tokens`` rows (a class token, distillation token) are kept as they
    are; the rest are interpolated: with ``grid=True`` as a square ``g x g`` grid
    resized to ``g' x g'`` (both lengths minus the prefix must be squares), else as a
    1-D sequence. ``method`` is 'bilinear' (or 'linear') or 'bicubic' (or 'cubic'), with
    ``tf.image.resize``'s half-pixel convention (see ``resize_matrix``).

    Example:
        >>> policy = {'pos_embed': restorekit.ResizePositions(num_prefix_tokens=1, grid=True)}
        >>> restorekit.restore(restorekit.scan('vit-224/', model_384, shape_policy=policy))

    The string ``'resize_positions'`` is ``ResizePositions()`` (one prefix token, a grid, bilinear).
    """

    num_prefix_tokens: int = 1
    grid: bool = True
    method: str = "bilinear"
    name = RESIZE_POSITIONS

    def __post_init__(self):
        n = self.num_prefix_tokens
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
            raise InvalidArgumentError(f"ResizePositions num_prefix_tokens must be an int >= 0, got {n!r}")
        if not isinstance(self.grid, bool):
            raise InvalidArgumentError(f"ResizePositions grid must be True or False, got {self.grid!r}")
        if self.method not in _METHODS:
            raise InvalidArgumentError(f"ResizePositions method is one of {sorted(_METHODS)}, got {self.method!r}")

    def _lengths(self, shape, checkpoint_shape):
        """(old, new) lengths of the interpolated part, or None when the shapes do not fit."""
        if shape is None or None in shape or len(shape) < 2 or len(shape) != len(checkpoint_shape):
            return None
        if tuple(shape[:-2]) != tuple(checkpoint_shape[:-2]) or shape[-1] != checkpoint_shape[-1]:
            return None
        old, new = checkpoint_shape[-2] - self.num_prefix_tokens, shape[-2] - self.num_prefix_tokens
        if old < 1 or new < 1:
            return None
        if self.grid and (_square_side(old) is None or _square_side(new) is None):
            return None
        return old, new

    def applies(self, shape, checkpoint_shape) -> bool:
        return self._lengths(shape, checkpoint_shape) is not None

    def adapt(self, value, shape):
        value = np.asarray(value)
        lengths = self._lengths(tuple(shape), value.shape)
        if lengths is None:
            raise InvalidArgumentError(f"{self!r} cannot resize a {format_shape(value.shape)} table to {format_shape(shape)}")
        old, new = lengths
        method = _METHODS[self.method]
        k = self.num_prefix_tokens
        prefix, table = value[..., :k, :], value[..., k:, :].astype(np.float64)
        if self.grid:
            g, h = _square_side(old), _square_side(new)
            assert g is not None and h is not None  # _lengths refused a grid that is not square
            matrix = resize_matrix(g, h, method)
            grid = table.reshape(*table.shape[:-2], g, g, table.shape[-1])
            # rows, then columns: the separable form of a 2-D resize
            grid = np.einsum("ij,...jkd->...ikd", matrix, grid)
            grid = np.einsum("ij,...kjd->...kid", matrix, grid)
            resized = grid.reshape(*table.shape[:-2], new, table.shape[-1])
        else:
            resized = np.einsum("ij,...jd->...id", resize_matrix(old, new, method), table)
        return np.concatenate([prefix, resized.astype(value.dtype)], axis=-2)


@dataclass(frozen=True)
class AdaptInputChannels(ShapeAdapter):
    """Adapt a convolution kernel to another number of input channels (RGB weights for a grayscale model).

    The input-channel axis is ``axis`` (-2: Keras / TF ``[kh, kw, C_in, C_out]`` kernels,
    also 1-D and 3-D ones); every other axis must agree. To one channel: the sum over the
    old channels (a gray image seen as R = G = B gives the same response). To C' other
    channels: the old channels repeated to C' (cut where C' is not a multiple of C) and
    scaled by C / C' (for C' a multiple of C, the response to a constant input stays), as timm's
    ``adapt_input_conv`` does.

    The string ``'adapt_input_channels'`` is ``AdaptInputChannels()``.
    """

    axis: int = -2
    name = ADAPT_INPUT_CHANNELS

    def __post_init__(self):
        if isinstance(self.axis, bool) or not isinstance(self.axis, numbers.Integral):
            raise InvalidArgumentError(f"AdaptInputChannels axis must be an int, got {self.axis!r}")

    def applies(self, shape, checkpoint_shape) -> bool:
        if shape is None or None in shape or len(shape) < 3 or len(shape) != len(checkpoint_shape):
            return False
        if not -len(shape) <= self.axis < len(shape):
            return False
        axis = self.axis % len(shape)
        return all(m == c for d, (m, c) in enumerate(zip(shape, checkpoint_shape)) if d != axis) and shape[axis] > 0

    def adapt(self, value, shape):
        value = np.asarray(value)
        if not self.applies(tuple(shape), value.shape):
            raise InvalidArgumentError(f"{self!r} cannot adapt a {format_shape(value.shape)} kernel to {format_shape(shape)}")
        axis = self.axis % value.ndim
        old, new = value.shape[axis], shape[axis]
        wide = value.astype(np.float64)
        if new == 1:
            adapted = wide.sum(axis=axis, keepdims=True)
        else:
            repeats = -(-new // old)
            adapted = np.take(np.concatenate([wide] * repeats, axis=axis), np.arange(new), axis=axis) * (old / new)
        return adapted.astype(value.dtype)


_ADAPTERS = {RESIZE_POSITIONS: ResizePositions, ADAPT_INPUT_CHANNELS: AdaptInputChannels}
