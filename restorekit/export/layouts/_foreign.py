"""Files written by other tools carry no layout record: map their PyTorch names back to TF (Keras) names by rule."""

from __future__ import annotations

import warnings

from restorekit.errors import NameCollisionError, RestoreKitWarning
from restorekit.export.layouts._names import KERNEL_PERMS
from restorekit.export.layouts._record import LayoutRecord


def guess_tf_names(shapes: dict):
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

    Args:
        shapes: stored name -> shape, for every tensor in the file.

    Raises:
        NameCollisionError: two stored names map to one TF name.
    """
    record = LayoutRecord(layout="torch")
    norm_scopes = {n.rpartition(".")[0] for n, s in shapes.items() if n.endswith("weight") and len(s) == 1}
    norm_scopes |= {n.rpartition(".")[0] for n in shapes if n.endswith(("running_mean", "running_var"))}
    bias_of = {n.rpartition(".")[0]: tuple(s) for n, s in shapes.items() if n.rpartition(".")[2] == "bias"}
    owners: dict[str, str] = {}
    guessed: list = []
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
    record.warn_unmapped(stacklevel=3)
    if guessed:
        warnings.warn(
            f"no layout record in the file: {len(guessed)} weight(s) without a bias were taken for Linear or "
            f"convolution weights and transposed into TF kernels ({', '.join(map(repr, guessed[:6]))}"
            f"{', ...' if len(guessed) > 6 else ''}); an RNN projection or a table of the same rank would be "
            f"wrong: check them", RestoreKitWarning, stacklevel=3)
    return record


def _is_embedding(scope: str) -> bool:
    module = scope.rpartition(".")[2].lower()
    # not 'embed_out' (GPT-NeoX's LM head), 'embed_proj' or 'unembed': those are Linear
    return module.endswith(("embeddings", "embedding")) or module in ("embed", "embed_tokens", "embed_positions", "wte", "wpe", "shared")
