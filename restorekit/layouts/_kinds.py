"""Each layer kind's torch.nn counterpart: which tensors it stores, under which names, after which steps.

See the table in ``restorekit.layouts``; the steps are those of ``ops``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from restorekit.errors import InvalidArgumentError
from restorekit.layouts._flatten import reorder_ops
from restorekit.layouts._names import KERNEL_PERMS, dotted
from restorekit.layouts._ops import stored_shape

ATTENTION_PARTS = ("query", "key", "value", "attention_output")
_CELL = re.compile(r"(.*_)?cell(_\d+)?")
# Keras LSTM gates i, f, c, o are torch's i, f, g, o; Keras GRU z, r, h become torch's
# r, z, n; TF1 LSTMCell's i, j, f, o (j the candidate) become i, f, j, o.
_KERAS_GATES = {4: None, 3: [1, 0, 2], 1: None}
_TF1_LSTM_GATES = [0, 2, 1, 3]
_RNN_NAMES = {4: "LSTM", 3: "GRU", 1: "SimpleRNN"}
_NORM_LEAVES = {"gamma": "weight", "beta": "bias", "moving_mean": "running_mean", "moving_variance": "running_var"}


@dataclass
class Part:
    """One stored tensor: its name, the TF key it comes from (None: added for PyTorch) and how."""

    stored: str
    key: str | None
    kind: str
    shape: tuple
    dtype: str
    ops: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)  # {'sum': [...]} or {'drop': True, 'fill': value}

    def note(self, first: bool) -> dict:
        """The record's note for this part (``first``: the first part of its TF tensor)."""
        if self.key is None:
            return {"drop": True}
        note: dict[str, object] = {"name": self.key} if self.stored != self.key else {}
        if set(self.ops) == {"perm"} and not self.extra:
            note["perm"] = list(self.ops["perm"])
        elif self.ops:
            note["ops"] = {k: list(v) if isinstance(v, tuple) else v for k, v in self.ops.items()}
            if "perm" in self.ops and first:
                note["perm"] = list(self.ops["perm"])
        if "sum" in self.extra:
            note["sum"] = list(self.extra["sum"])
        return note


@dataclass
class Context:
    scopes: set  # every layer scope of the checkpoint
    forget_bias: float
    hints: dict  # layer scope -> Keras class name, lowercased
    flatten: dict | None = None  # Dense layer name -> FlattenInput, from the model's config (None: no config)
    flatten_channels: dict = field(default_factory=dict)  # the caller's {Dense path or name: channels or None}
    unsure: dict = field(default_factory=dict)  # Dense scope -> why its columns may be in Keras' order

    def dense_ops(self, scope: str, kernel_shape: tuple) -> dict:
        """The ops of a Dense kernel: a transpose, and the column reorder when it reads a flattened feature map."""
        last = scope.rpartition("/")[2]
        for key in (scope, last):
            if key in self.flatten_channels:
                channels = self.flatten_channels[key]
                return {"perm": (1, 0)} if channels is None else reorder_ops(kernel_shape, int(channels), scope)
        found = (self.flatten or {}).get(last)
        if found is None:
            return {"perm": (1, 0)}
        if found.why is not None:
            self.unsure[scope] = found.why
            return {"perm": (1, 0)}
        try:
            return reorder_ops(kernel_shape, found.channels, scope)
        except InvalidArgumentError:
            self.unsure[scope] = (f"it reads {found.via!r}'s flattened map of {found.channels} channels, which its "
                                  f"{kernel_shape[0]} inputs do not divide")
            return {"perm": (1, 0)}

    def text(self, scope: str, leaves: dict) -> str:
        """All names a layer is known by, lowercased, plus a kind hint the caller gave."""
        last = scope.rpartition("/")[2].lower()
        return " ".join([last, self.hints.get(scope, "")] + [v.hint for v in leaves.values()])


def is_cell(segment: str) -> bool:
    return bool(_CELL.fullmatch(segment))


def map_layer(scope: str, leaves: dict, ctx: Context) -> tuple[list, dict]:
    """(parts, {TF key: why unmapped}) for one layer: ``leaves`` maps leaf name -> Var."""
    mapper, why = _kind(scope, leaves, ctx)
    if mapper is None:
        return _fallback(scope, leaves, why, whole=why is not None)
    rest = dict(leaves)
    parts = mapper(scope, rest, ctx)
    if isinstance(parts, str):  # the kind is known but these tensors do not fit it
        return _fallback(scope, leaves, parts, whole=True)
    rest_parts, unmapped = _fallback(scope, rest, f"not part of the {parts[0].kind} that layout 'torch' maps", whole=False)
    return parts + rest_parts, unmapped


def _kind(scope: str, leaves: dict, ctx: Context):
    """(mapper, None) or (None, why) for a layer."""
    last = scope.rpartition("/")[2]
    parent = scope.rpartition("/")[0]
    if "recurrent_kernel" in leaves and "kernel" in leaves:
        return _keras_rnn, None
    if "depthwise_kernel" in leaves:
        return _separable, None
    if "moving_mean" in leaves and "moving_variance" in leaves:
        return _batch_norm, None
    if last in ("gates", "candidate") and is_cell(parent.rpartition("/")[2]) and "gru" in parent.lower():
        return None, ("a TF1 GRUCell applies its reset gate before the recurrent matmul; torch.nn.GRU applies it "
                      "after, so no nn.GRU computes what it computes")
    if "kernel" in leaves and is_cell(last) and "lstm" in last and "recurrent_kernel" not in leaves:
        return _tf1_lstm, None
    if "kernel" in leaves and last in ATTENTION_PARTS and all(f"{parent}/{p}" in ctx.scopes for p in ATTENTION_PARTS):
        return _attention, None
    if "kernel" in leaves and len(leaves["kernel"].shape) >= 2:
        return _kernel_kind(scope, leaves, ctx)
    if "embeddings" in leaves and len(leaves["embeddings"].shape) == 2:
        return _embedding, None
    if "gamma" in leaves or "beta" in leaves:
        return _norm, None
    return None, None


def _kernel_kind(scope: str, leaves: dict, ctx: Context):
    kernel, bias = leaves["kernel"].shape, leaves["bias"].shape if "bias" in leaves else None
    text = ctx.text(scope, leaves)
    if len(kernel) == 2:
        return _dense, None
    if len(kernel) not in KERNEL_PERMS:
        return None, f"a kernel of rank {len(kernel)} matches no torch.nn layer"
    if "einsum" in text or (bias is not None and len(bias) > 1):
        return _einsum, None
    if "depthwise" in text:
        return _depthwise, None
    if "transpose" in text or "conv" in ctx.hints.get(scope, "") or bias is None:
        return _conv, None
    size = bias[0]
    if size == kernel[-1]:  # Conv (out last); a ConvTranspose with out == in takes the same axes
        return _conv, None
    if size == kernel[-2] * kernel[-1] and kernel[-2] > 1:
        return _depthwise, None
    if size == kernel[-2] and kernel[-1] > 1:  # ConvTranspose: [..., out, in]
        return _conv, None
    if size == kernel[-2]:
        return None, (f"a kernel {list(kernel)} with bias [{size}] is a depthwise convolution or a transposed one "
                      "with one input channel, and no name says which; pass layer_kinds={scope: 'DepthwiseConv2D'} "
                      "(or 'Conv2DTranspose')")
    return None, f"a kernel {list(kernel)} with bias [{size}] matches no convolution"


def _part(stored, var, kind, ops=None, extra=None):

    ops = ops or {}
    return Part(stored, var.key, kind, stored_shape(ops, var.shape), var.dtype, ops, extra or {})


def _added(stored, kind, shape, dtype, fill):
    return Part(stored, None, kind, tuple(shape), dtype, {}, {"drop": True, "fill": fill})


def _module(scope: str) -> str:
    return dotted(scope) if scope else ""


def _name(module: str, leaf: str) -> str:
    return f"{module}.{leaf}" if module else leaf


def _dense(scope, leaves, ctx):
    m = _module(scope)
    kernel = leaves.pop("kernel")
    parts = [_part(_name(m, "weight"), kernel, "Dense", ctx.dense_ops(scope, kernel.shape))]
    if "bias" in leaves:
        parts.append(_part(_name(m, "bias"), leaves.pop("bias"), "Dense"))
    return parts


def _conv(scope, leaves, ctx):
    m = _module(scope)
    kernel = leaves.pop("kernel")
    kind = f"Conv{len(kernel.shape) - 2}D"
    parts = [_part(_name(m, "weight"), kernel, kind, {"perm": KERNEL_PERMS[len(kernel.shape)]})]
    if "bias" in leaves:
        parts.append(_part(_name(m, "bias"), leaves.pop("bias"), kind))
    return parts


def _depthwise_ops(shape: tuple) -> dict:
    """[*spatial, in, mult] -> torch's grouped conv weight [in * mult, 1, *spatial] (output channel c*mult + m)."""
    r = len(shape)
    perm = (r - 2, r - 1) + tuple(range(r - 2))
    before = tuple(shape[i] for i in perm)
    return {"perm": perm, "view": (before, (shape[-2] * shape[-1], 1) + tuple(shape[:-2]))}


def _depthwise(scope, leaves, ctx):
    m = _module(scope)
    kernel = leaves.pop("kernel") if "kernel" in leaves else leaves.pop("depthwise_kernel")
    kind = f"DepthwiseConv{len(kernel.shape) - 2}D"
    parts = [_part(_name(m, "weight"), kernel, kind, _depthwise_ops(kernel.shape))]
    if "bias" in leaves:
        parts.append(_part(_name(m, "bias"), leaves.pop("bias"), kind))
    return parts


def _separable(scope, leaves, ctx):
    if "pointwise_kernel" not in leaves:  # tf-slim separable_conv2d with num_outputs=None: depthwise only
        return _depthwise(scope, leaves, ctx)
    m = _module(scope)
    depthwise, pointwise = leaves.pop("depthwise_kernel"), leaves.pop("pointwise_kernel")
    kind = f"SeparableConv{len(depthwise.shape) - 2}D"
    if len(pointwise.shape) not in KERNEL_PERMS or len(depthwise.shape) < 3:
        return f"a {kind} with kernels {list(depthwise.shape)} and {list(pointwise.shape)} matches no torch.nn convolutions"
    parts = [
        _part(_name(m, "depthwise.weight"), depthwise, kind, _depthwise_ops(depthwise.shape)),
        _part(_name(m, "pointwise.weight"), pointwise, kind, {"perm": KERNEL_PERMS[len(pointwise.shape)]}),
    ]
    if "bias" in leaves:
        parts.append(_part(_name(m, "pointwise.bias"), leaves.pop("bias"), kind))
    return parts


def _batch_norm(scope, leaves, ctx):
    m = _module(scope)
    mean = leaves["moving_mean"]
    parts = [_part(_name(m, _NORM_LEAVES[leaf]), leaves.pop(leaf), "BatchNormalization")
             for leaf in ("gamma", "beta", "moving_mean", "moving_variance") if leaf in leaves]
    # torch's BatchNorm is affine for both or neither; a TF BatchNorm with only one
    # (tf-slim's default: beta without gamma) gets the other as its identity value.
    names = {p.stored for p in parts}
    if (_name(m, "weight") in names) != (_name(m, "bias") in names):
        missing, fill = ("weight", 1) if _name(m, "weight") not in names else ("bias", 0)
        parts.append(_added(_name(m, missing), "BatchNormalization", mean.shape, mean.dtype, fill))
    if "num_batches_tracked" in leaves:  # a torch file's own, back from its guessed TF names: kept, not added again
        parts.append(_part(_name(m, "num_batches_tracked"), leaves.pop("num_batches_tracked"), "BatchNormalization"))
    else:
        parts.append(_added(_name(m, "num_batches_tracked"), "BatchNormalization", (), "int64", 0))
    return parts


def _norm(scope, leaves, ctx):
    m = _module(scope)
    return [_part(_name(m, _NORM_LEAVES[leaf]), leaves.pop(leaf), "Normalization")
            for leaf in ("gamma", "beta") if leaf in leaves]


def _embedding(scope, leaves, ctx):
    return [_part(_name(_module(scope), "weight"), leaves.pop("embeddings"), "Embedding")]


def _einsum_in(kernel, bias, module, kind):
    """EinsumDense contracting the kernel's first axis: a Linear(in, prod(out)) over the flattened outputs."""
    shape = kernel.shape
    perm = tuple(range(1, len(shape))) + (0,)
    out = 1
    for d in shape[1:]:
        out *= d
    parts = [_part(_name(module, "weight"), kernel, kind, {"perm": perm, "view": (tuple(shape[i] for i in perm), (out, shape[0]))})]
    if bias is not None:
        ops = {"view": (tuple(bias.shape), (out,))} if len(bias.shape) > 1 else {}
        parts.append(_part(_name(module, "bias"), bias, kind, ops))
    return parts


def _einsum(scope, leaves, ctx):
    kernel, bias = leaves["kernel"], leaves.get("bias")
    if bias is None or tuple(bias.shape) != tuple(kernel.shape[1:]):
        return ("an EinsumDense kernel is mapped when its bias covers every output axis (one contracted "
                "input axis); the equation is not in the checkpoint")
    leaves.pop("kernel"), leaves.pop("bias")
    return _einsum_in(kernel, bias, _module(scope), "EinsumDense")


def _attention(scope, leaves, ctx):
    """MultiHeadAttention as four Linear layers: query/key/value [d, heads, dim] -> [heads*dim, d];
    attention_output [heads, dim, d] -> [d, heads*dim]."""
    kernel, bias = leaves.pop("kernel"), leaves.pop("bias", None)
    m, shape = _module(scope), kernel.shape
    if scope.rpartition("/")[2] != "attention_output":
        if len(shape) != 3 or (bias is not None and tuple(bias.shape) != tuple(shape[1:])):
            return f"a MultiHeadAttention projection kernel {list(shape)} is not [dim, heads, head_dim]"
        return _einsum_in(kernel, bias, m, "MultiHeadAttention")
    if len(shape) != 3 or (bias is not None and tuple(bias.shape) != (shape[-1],)):
        return f"a MultiHeadAttention output kernel {list(shape)} is not [heads, head_dim, dim]"
    ops = {"perm": (2, 0, 1), "view": ((shape[2], shape[0], shape[1]), (shape[2], shape[0] * shape[1]))}
    parts = [_part(_name(m, "weight"), kernel, "MultiHeadAttention", ops)]
    if bias is not None:
        parts.append(_part(_name(m, "bias"), bias, "MultiHeadAttention"))
    return parts


def _rnn_module(scope: str) -> str:
    parent, _, last = scope.rpartition("/")
    return _module(parent if parent and is_cell(last) else scope)


def _keras_rnn(scope, leaves, ctx):
    kernel, recurrent, bias = leaves["kernel"], leaves["recurrent_kernel"], leaves.get("bias")
    units, cols = recurrent.shape if len(recurrent.shape) == 2 else (0, 0)
    gates = cols // units if units and cols % units == 0 else 0
    if gates not in _RNN_NAMES or len(kernel.shape) != 2 or kernel.shape[1] != cols:
        return f"a recurrent kernel {list(recurrent.shape)} with kernel {list(kernel.shape)} is no LSTM, GRU or SimpleRNN"
    kind = _RNN_NAMES[gates]
    if gates in (3, 4) and bias is not None and tuple(bias.shape) == (2 * cols,):
        return _cudnn_rnn(scope, leaves, kind, gates, units)
    if kind == "GRU" and (bias is None or len(bias.shape) != 2):
        return ("a Keras GRU without a [2, 3*units] bias has reset_after=False (or cannot show reset_after): "
                "it applies the reset gate before the recurrent matmul, torch.nn.GRU after")
    m, order = _rnn_module(scope), _KERAS_GATES[gates]
    weight_ops = {"gates": (1, order), "perm": (1, 0)} if order else {"perm": (1, 0)}
    parts = [_part(_name(m, "weight_ih_l0"), leaves.pop("kernel"), kind, weight_ops),
             _part(_name(m, "weight_hh_l0"), leaves.pop("recurrent_kernel"), kind, weight_ops)]
    if bias is None:
        return parts
    leaves.pop("bias")
    if kind == "GRU":  # reset_after: row 0 is the input bias, row 1 the recurrent one, as torch has them
        return parts + [_part(_name(m, f"bias_{side}_l0"), bias, kind, {"take": (0, row), "gates": (0, order)})
                        for row, side in ((0, "ih"), (1, "hh"))]
    return parts + [_part(_name(m, "bias_ih_l0"), bias, kind), _part(_name(m, "bias_hh_l0"), bias, kind, {}, {"sum": [0.0]})]


def _cudnn_rnn(scope, leaves, kind, gates, units):
    """A Keras 2 CuDNNLSTM / CuDNNGRU: each gate's input kernel block [in, u] holds cuDNN's [u, in] matrix in
    C order, each recurrent block [u, u] is torch's block as it is, and the bias holds the input then the
    recurrent biases, as ``nn.LSTM`` / ``nn.GRU`` have them (what tf-keras' CuDNN conversion undoes)."""
    kernel, recurrent, bias = leaves.pop("kernel"), leaves.pop("recurrent_kernel"), leaves.pop("bias")
    m, order, cols = _rnn_module(scope), _KERAS_GATES[gates], gates * units
    kind = f"CuDNN{kind}"

    def blocks(var):  # [rows, gates*u] -> [gates*u, rows] of gate blocks, each block's bytes as they are
        rows = var.shape[0]
        ops = {"split": ((rows, cols), (rows, gates, units)), "perm": (1, 0, 2),
               "view": ((gates, rows, units), (cols, rows))}
        return {**ops, "gates": (1, order)} if order else ops

    parts = [_part(_name(m, "weight_ih_l0"), kernel, kind, blocks(kernel)),
             _part(_name(m, "weight_hh_l0"), recurrent, kind, blocks(recurrent))]
    for side, (start, stop) in (("ih", (0, cols)), ("hh", (cols, 2 * cols))):
        ops = {"take": (0, start, stop), "gates": (0, order)} if order else {"take": (0, start, stop)}
        parts.append(_part(_name(m, f"bias_{side}_l0"), bias, kind, ops))
    return parts


def _tf1_lstm(scope, leaves, ctx):
    """tf.compat.v1 LSTMCell / BasicLSTMCell: one kernel [in + units, 4*units] over [inputs, state],
    gates i, j, f, o, and ``forget_bias`` added to f at run time (stored here in ``bias_hh_l0``)."""
    kernel, bias = leaves["kernel"], leaves.get("bias")
    extra = sorted(set(leaves) - {"kernel", "bias"})
    if extra or any(s.startswith(f"{scope}/") for s in ctx.scopes):
        return f"an LSTMCell with peepholes or a projection ({', '.join(extra) or 'projection'}) has no nn.LSTM twin"
    rows, cols = kernel.shape if len(kernel.shape) == 2 else (0, 0)
    units = cols // 4
    if cols % 4 or rows <= units or bias is None or tuple(bias.shape) != (cols,):
        return f"an LSTMCell kernel {list(kernel.shape)} is not [inputs + units, 4*units] with a bias"
    m, n_in = _rnn_module(scope), rows - units
    leaves.pop("kernel"), leaves.pop("bias")
    gates = (1, _TF1_LSTM_GATES)
    return [
        _part(_name(m, "weight_ih_l0"), kernel, "LSTMCell", {"take": (0, 0, n_in), "gates": gates, "perm": (1, 0)}),
        _part(_name(m, "weight_hh_l0"), kernel, "LSTMCell", {"take": (0, n_in, rows), "gates": gates, "perm": (1, 0)}),
        _part(_name(m, "bias_ih_l0"), bias, "LSTMCell", {"gates": (0, _TF1_LSTM_GATES)}),
        _part(_name(m, "bias_hh_l0"), bias, "LSTMCell", {"gates": (0, _TF1_LSTM_GATES)},
              {"sum": [0.0, float(ctx.forget_bias), 0.0, 0.0]}),
    ]


def _fallback(scope: str, leaves: dict, why: str | None, whole: bool) -> tuple[list, dict]:
    """Tensors of no mapped layer: vectors and scalars (and embedding tables) keep their
    layout under dotted names; anything else of rank >= 2 is stored in TF layout and listed.
    ``whole``: the layer's kind is known and cannot be mapped, so every tensor is listed."""
    from restorekit.layouts._names import LEAVES

    parts, unmapped = [], {}
    module = _module(scope)
    for leaf, var in leaves.items():
        keeps_layout = len(var.shape) <= 1 or (len(var.shape) == 2 and leaf.endswith(("embeddings", "embedding")))
        if keeps_layout and not whole:
            parts.append(_part(_name(module, LEAVES.get(leaf, leaf)), var, "other"))
            continue
        parts.append(_part(_name(module, leaf), var, "unmapped"))
        unmapped[var.key] = why or f"a rank-{len(var.shape)} {leaf!r} in no layer that layout 'torch' knows"
    return parts, unmapped
