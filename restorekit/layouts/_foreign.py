"""Files written by other tools carry no layout record: map their PyTorch names back to TF (Keras) names by rule."""

from __future__ import annotations

import warnings

from restorekit.errors import InvalidArgumentError, NameCollisionError, RestoreKitWarning, format_names
from restorekit.layouts._names import KERNEL_PERMS
from restorekit.layouts._record import LayoutRecord


def guess_tf_names(shapes: dict, *, flatten_channels: dict | None = None, flatten: dict | None = None):
    """A record mapping PyTorch-style names of a foreign file back to TF (Keras) names.

    Rules, by name and rank: ``.`` -> ``/``; ``weight`` of rank >= 2 -> ``kernel`` with
    the inverse kernel permutation; ``weight`` of rank 1 -> ``gamma``, and its sibling
    ``bias`` -> ``beta``; ``running_mean``/``running_var`` -> ``moving_mean``/
    ``moving_variance``. A rank-2 ``weight`` without a ``bias`` whose module is named
    like an embedding (``*embeddings``, ``*embedding``, ``embed``, ``embed_tokens``,
    ``embed_positions``, ``wte``, ``wpe``, ``shared``; not ``embed_out`` or
    ``embed_proj``) is a table: it becomes ``embeddings``, untransposed, as Keras names it.
    Other embedding tables cannot be told from Dense weights and come back transposed
    as ``kernel``: rename them after. Depthwise convolutions (``groups`` > 1) cannot be
    told from their weights either. A ``weight`` of rank >= 2 whose sibling ``bias`` does
    not have its first dimension (a ``[1, 264]`` LayerNorm scale beside a ``[264]`` bias)
    belongs to no Linear or convolution: it keeps its name and axes and is warned about.
    Kernels without a bias are guesses (an RNN projection has the same rank) and are
    warned about by name.

    A Linear that reads a convolution's map through ``nn.Flatten`` holds its columns channel
    first, a Keras Dense position first (``restorekit.layouts._flatten``): given its
    map's channels (``flatten_channels``, ``{TF layer path or name: channels or None}``, or
    ``flatten``, ``{layer name: FlattenInput}`` from the Keras model it goes to), its columns
    are reordered; otherwise a Linear whose input size is a multiple of a convolution's
    channels is warned about by name.

    Args:
        shapes: stored name -> shape, for every tensor in the file.

    Raises:
        NameCollisionError: two stored names map to one TF name.
        InvalidArgumentError: ``flatten_channels`` naming no Linear, or channels not dividing its inputs.
    """
    record = LayoutRecord(layout="torch")
    norm_scopes = {n.rpartition(".")[0] for n, s in shapes.items() if n.endswith("weight") and len(s) == 1}
    norm_scopes |= {n.rpartition(".")[0] for n in shapes if n.endswith(("running_mean", "running_var"))}
    bias_of = {n.rpartition(".")[0]: tuple(s) for n, s in shapes.items() if n.rpartition(".")[2] == "bias"}
    owners: dict[str, str] = {}
    guessed: list = []
    reorders = _reorders(shapes, bias_of, dict(flatten_channels or {}), flatten)
    for stored, shape in shapes.items():
        scope, _, leaf = stored.rpartition(".")
        perm = None
        bias = bias_of.get(scope)
        if leaf == "weight":
            if len(shape) == 2 and bias is None and _is_embedding(scope):
                leaf = "embeddings"
            elif len(shape) >= 2 and bias is not None and bias != (shape[0],):
                record.unmapped[f"{scope.replace('.', '/')}/weight"] = (
                    f"a weight {list(shape)} beside a bias {list(bias)} is no Linear or convolution (their bias has "
                    f"the weight's first dimension); kept with its name and axes")
            elif len(shape) >= 2 and len(shape) in KERNEL_PERMS:
                leaf, perm = "kernel", KERNEL_PERMS[len(shape)]
                if bias is None:
                    guessed.append(stored)
            elif len(shape) == 1:
                leaf = "gamma"
        elif leaf == "bias" and scope in norm_scopes:
            leaf = "beta"
        else:
            leaf = {"running_mean": "moving_mean", "running_var": "moving_variance"}.get(leaf, leaf)
        name = f"{scope.replace('.', '/')}/{leaf}" if scope else leaf
        if name in owners:
            raise NameCollisionError(f"{owners[name]!r} and {stored!r} both map back to {name!r}")
        owners[name] = stored
        record.note_tensor(stored, name, perm)
        if stored in reorders and reorders[stored] is not None:
            record.tensors[stored] = {"name": name, "ops": reorders[stored]}
    record.warn_unmapped(stacklevel=3)
    unsure = {stored: why for stored, why in reorders.items() if isinstance(why, str)}
    if unsure:
        shown = "; ".join(f"{s!r}: {why}" for s, why in list(unsure.items())[:4])
        warnings.warn(
            f"no layout record in the file: {len(unsure)} Linear weight(s) may read a flattened feature map ({shown}). "
            f"torch.nn.Flatten after a Conv2d flattens channel first, Keras' Flatten position first, so behind a "
            f"Flatten these columns are in the wrong order for a Keras Dense; pass flatten_channels={{<layer>: "
            f"<channels>}} to reorder them, or {{<layer>: None}} if no Flatten precedes it",
            RestoreKitWarning, stacklevel=3)
    if guessed:
        warnings.warn(
            f"no layout record in the file: {len(guessed)} weight(s) without a bias were taken for Linear or "
            f"convolution weights and transposed into TF kernels ({', '.join(map(repr, guessed[:6]))}"
            f"{', ...' if len(guessed) > 6 else ''}); an RNN projection or a table of the same rank would be "
            f"wrong: check them", RestoreKitWarning, stacklevel=3)
    return record


def _reorders(shapes: dict, bias_of: dict, given: dict, flatten: dict | None) -> dict:
    """{stored Linear weight: the ops of its reorder, None (none), or why it may need one (a str)}."""
    from restorekit.layouts._flatten import reorder_ops

    given = {k.strip("/").replace("/", "."): v for k, v in given.items()}
    linears = {n: tuple(s) for n, s in shapes.items() if n.rpartition(".")[2] == "weight" and len(s) == 2
               and bias_of.get(n.rpartition(".")[0]) == (s[0],)}
    scopes = {n.rpartition(".")[0]: n for n in linears}
    names = set(scopes) | {s.rpartition(".")[2] for s in scopes}
    unknown = [k for k in given if k not in names]
    if unknown:
        raise InvalidArgumentError(f"flatten_channels names no Linear layer: {format_names(unknown)} (Linear layers: "
                                   f"{format_names(sorted(scopes)) or 'none'})")
    convs = [(n.rpartition(".")[0], int(s[0])) for n, s in shapes.items()
             if n.rpartition(".")[2] == "weight" and len(s) in (3, 4, 5)]
    out: dict = {}
    for scope, stored in scopes.items():
        out_dim, inputs = linears[stored]
        last = scope.rpartition(".")[2]
        key = scope if scope in given else last if last in given else None
        if key is not None:
            channels = given[key]
        elif flatten is not None:
            found = flatten.get(last)
            channels = found.channels if found is not None else None
            if found is not None and found.why is not None:
                out[stored] = found.why
                continue
        else:
            fitting = [(c, n) for c, n in convs if n > 1 and inputs > n and inputs % n == 0]
            if fitting:
                out[stored] = f"its {inputs} inputs are a multiple of the {fitting[-1][1]} channels of {fitting[-1][0]!r}"
            continue
        if channels is not None:
            ops = reorder_ops((inputs, out_dim), int(channels), scope)
            out[stored] = ops if "view" in ops else None
    return out


def _is_embedding(scope: str) -> bool:
    module = scope.rpartition(".")[2].lower()
    # not 'embed_out' (GPT-NeoX's LM head), 'embed_proj' or 'unembed': those are Linear
    return module.endswith(("embeddings", "embedding")) or module in ("embed", "embed_tokens", "embed_positions", "wte", "wpe", "shared")
