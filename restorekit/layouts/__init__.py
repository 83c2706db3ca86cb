"""Name and axis conventions between TensorFlow and PyTorch (``layout='torch'``), in both directions.

``layout='torch'`` maps each layer to its ``torch.nn`` counterpart. The kind of a layer
is told from the tensors it holds (``plan``), for functional, Sequential, subclassed
and nested Keras models, ``tf.Module`` trees, tf-slim and TF1 graphs:

=======================================  ==========================================  ==================================
TensorFlow layer (leaves)                PyTorch module (names)                      values
=======================================  ==========================================  ==================================
Dense ``kernel`` [in,out], ``bias``      ``nn.Linear`` ``weight`` [out,in], ``bias``  transposed
Conv1D/2D/3D ``kernel`` [*k,in,out]      ``nn.ConvNd`` ``weight`` [out,in,*k]         axes (r-1, r-2, 0, ...)
Conv*Transpose ``kernel`` [*k,out,in]    ``nn.ConvTransposeNd`` [in,out,*k]           the same axes
DepthwiseConv ``kernel`` [*k,in,m]       ``nn.ConvNd(groups=in)`` [in*m,1,*k]         axes, then a reshape
SeparableConv ``depthwise_kernel``,      ``depthwise.weight`` (groups=in, no bias),   as Depthwise and Conv
``pointwise_kernel``, ``bias``           ``pointwise.weight``, ``pointwise.bias``
BatchNormalization ``gamma`` ``beta``    ``nn.BatchNormNd`` ``weight`` ``bias``       unchanged; ``num_batches_tracked``
``moving_mean`` ``moving_variance``      ``running_mean`` ``running_var``            added (0); a missing gamma/beta
                                                                                     added as 1/0 (torch is affine for
                                                                                     both or neither)
LayerNorm/GroupNorm ``gamma`` ``beta``   ``weight`` ``bias``                          unchanged
Embedding ``embeddings``                 ``nn.Embedding`` ``weight``                  unchanged
EinsumDense ``kernel`` [in,*out],        ``nn.Linear(in, prod(out))``                 transposed, outputs flattened
``bias`` [*out]
MultiHeadAttention ``query|key|value``   four ``nn.Linear``: ``query``, ``key``,      q/k/v [d,h,hd] -> [h*hd,d],
[d,h,hd] + [h,hd], ``attention_output``  ``value``, ``attention_output``              bias [h*hd]; output [h,hd,d] ->
[h,hd,d] + [d]                                                                       [d,h*hd]
LSTM ``kernel`` ``recurrent_kernel``     ``nn.LSTM`` ``weight_ih_l0`` ``weight_hh_l0`` transposed (gates i,f,c,o = i,f,g,o);
``bias`` [4u]                            ``bias_ih_l0`` ``bias_hh_l0``               ``bias_hh_l0`` added as zeros
GRU (reset_after) ... ``bias`` [2,3u]    ``nn.GRU`` (same names)                      gates z,r,h -> r,z,n; bias rows
                                                                                     -> ``bias_ih_l0``, ``bias_hh_l0``
SimpleRNN                                ``nn.RNN`` (same names)                      as LSTM, one gate
Keras 2 CuDNNLSTM / CuDNNGRU ``kernel``  ``nn.LSTM`` / ``nn.GRU`` (same names)        each gate's kernel block read as
``recurrent_kernel`` ``bias`` [2*g*u]                                                cuDNN's [u, in] matrix, recurrent
                                                                                     blocks as they are, bias halves
                                                                                     -> ``bias_ih_l0``, ``bias_hh_l0``
TF1 LSTMCell/BasicLSTMCell ``kernel``    ``nn.LSTM`` (same names)                     rows split into ih/hh, gates
[in+u,4u], ``bias``                                                                  i,j,f,o -> i,f,j,o, forget_bias
                                                                                     in ``bias_hh_l0``
=======================================  ==========================================  ==================================

Names: ``/`` -> ``.``; TF2's ``/.ATTRIBUTES/VARIABLE_VALUE`` dropped; tf-slim leaves
(``weights``, ``biases``, ``depthwise_weights``) and private Keras attributes
(``_kernel``) read as the Keras leaves. A Keras RNN's cell scope is dropped
(``lstm/lstm_cell/kernel`` -> ``lstm.weight_ih_l0``). Object-based checkpoints name each
variable by its attribute path (``model/fc1/_kernel`` -> ``model.fc1.weight``, as a
torch twin with ``self.fc1 = nn.Linear(...)`` names it), except functional and
Sequential models, whose attribute paths run through Keras internals: their Keras
``variable.path`` (``dense_1/kernel``). Where those collide (nested functional blocks each
holding a ``fc``: both ``fc/kernel``), only the live model knows the layers' names:
``torch_view(checkpoint, model=model)`` names each variable by the layers on its way
(``block_a.fc.weight``, see ``live``); without it a warning says so.

The MultiHeadAttention twin: ``q = query(x).view(B, T, h, hd)`` (likewise k, v),
``softmax(q k^T / sqrt(hd)) v`` per head, concatenated to ``[B, T, h*hd]``, then
``attention_output``. Keras BatchNormalization's ``epsilon`` (1e-3) is torch's ``eps``.

Not mapped, stored with their TF names (dotted) and axes, listed in
``LayoutRecord.unmapped`` and warned about by name: GRUs with ``reset_after=False``
and TF1 ``GRUCell`` (they reset before the recurrent matmul, ``nn.GRU`` after), LSTM
cells with peepholes or projections, EinsumDense kernels whose equation the shapes
do not tell, kernels whose kind only a name could tell and no name tells (pass
``layer_kinds``), and any tensor of rank >= 2 in no known layer. Optimizer state
keeps TF axes and leaf names (``ExportResult.kept``): see ``plan``.

Every export records what it did in a :class:`LayoutRecord` stored inside the file
(safetensors ``__metadata__``, the ``_metadata`` of a torch ``state_dict``); the import
replays it backwards (``LayoutRecord.restore_all``) and is bit-exact. Files written by
other tools carry no record: :func:`guess_tf_names` then maps PyTorch names back by
name and rank (Keras names).

Optimizer state: Keras 3 optimizers record no link from a slot to its variable, factored
slots (Adafactor) have other shapes, and PyTorch optimizers key their state by
parameter index, so slots (``optimizer.adam.conv_kernel_momentum``,
``model.dense.kernel.OPTIMIZER_SLOT.optimizer.m``) are only named by their readable
path with dots. Name-based (TF1) slots (``dense/kernel/Adam``) keep their leaf and axes.
"""

from __future__ import annotations

from restorekit.layouts._names import (
    KERNEL_PERMS,
    LAYOUTS,
    LEAVES,
    METADATA_KEY,
    STORED_AS,
    check_layout,
    dotted,
    invert,
    restore_dtype,
    torch_name,
    torch_permutation,
)
from restorekit.layouts._foreign import guess_tf_names
from restorekit.layouts._plan import plan_checkpoint, readable_path
from restorekit.layouts._record import LayoutRecord, tf_tensors
from restorekit.layouts._view import TorchView, torch_view

__all__ = [
    "KERNEL_PERMS",
    "LAYOUTS",
    "LEAVES",
    "METADATA_KEY",
    "STORED_AS",
    "LayoutRecord",
    "TorchView",
    "check_layout",
    "dotted",
    "guess_tf_names",
    "invert",
    "plan_checkpoint",
    "readable_path",
    "restore_dtype",
    "tf_tensors",
    "torch_name",
    "torch_permutation",
    "torch_view",
]
