"""The hand-built ``torch.nn`` twins of tests/test_export_layouts.py's layers.

This module imports torch: import it only inside cases marked ``requires_torch``, so the
rest of that file runs without the optional extra.
"""

import math

import numpy as np
import torch
from torch import nn

from restorekit.formats import safetensors as st_format


def stored(path):
    """The tensors of an exported ``.pt`` or ``.safetensors`` file, as torch tensors."""
    if str(path).endswith(".pt"):
        return dict(torch.load(path, weights_only=True))
    return {k: torch.from_numpy(np.array(v)) for k, v in st_format.read(path)}


class Twin(nn.Module):
    def __init__(self, layer, forward):
        super().__init__()
        self.layer = layer
        self._forward = forward

    def forward(self, x):
        return self._forward(self.layer, x)


class Attention(nn.Module):
    """The MultiHeadAttention twin documented in restorekit.layouts."""

    def __init__(self, dim, heads, head_dim):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.query, self.key, self.value = (nn.Linear(dim, heads * head_dim) for _ in range(3))
        self.attention_output = nn.Linear(heads * head_dim, dim)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.heads, self.head_dim).transpose(1, 2) for p in (self.query, self.key, self.value))
        weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(self.head_dim), dim=-1)
        return self.attention_output((weights @ v).transpose(1, 2).reshape(b, t, -1))


class Separable(nn.Module):
    def __init__(self, c_in, mult, c_out, k):
        super().__init__()
        self.depthwise = nn.Conv2d(c_in, c_in * mult, k, groups=c_in, bias=False)
        self.pointwise = nn.Conv2d(c_in * mult, c_out, 1)

    def forward(self, x):
        return self.pointwise(self.depthwise(x))


def channels_first(f):
    """Run a channels-first torch module on a channels-last array, and back."""
    def run(module, x):
        dims = x.dim()
        y = module(x.permute(0, dims - 1, *range(1, dims - 1)))
        return y.permute(0, *range(2, dims), 1)
    return run


def plain(module, x):
    return module(x)


def rnn(module, x):
    return module(x)[0]


# name (a key of test_export_layouts.CASES): (torch module, forward)
TWINS = {
    "dense": (lambda: nn.Linear(3, 4), plain),
    "conv1d": (lambda: nn.Conv1d(3, 4, 3), channels_first(plain)),
    "conv2d": (lambda: nn.Conv2d(3, 4, 3), channels_first(plain)),
    "conv3d": (lambda: nn.Conv3d(3, 2, 2), channels_first(plain)),
    "conv1d_transpose": (lambda: nn.ConvTranspose1d(3, 4, 3, stride=2), channels_first(plain)),
    "conv2d_transpose": (lambda: nn.ConvTranspose2d(3, 4, 3, stride=2), channels_first(plain)),
    "depthwise_conv2d": (lambda: nn.Conv2d(3, 6, 3, groups=3), channels_first(plain)),
    "depthwise_conv2d_mult1": (lambda: nn.Conv2d(3, 3, 3, groups=3), channels_first(plain)),
    "separable_conv2d": (lambda: Separable(3, 2, 5, 3), channels_first(plain)),
    "batch_norm": (lambda: nn.BatchNorm1d(5, eps=1e-3), plain),
    "batch_norm_2d": (lambda: nn.BatchNorm2d(3, eps=1e-3), channels_first(plain)),
    "layer_norm": (lambda: nn.LayerNorm(5, eps=1e-3), plain),
    "group_norm": (lambda: nn.GroupNorm(2, 6, eps=1e-3), channels_first(plain)),
    "embedding": (lambda: nn.Embedding(10, 4), lambda m, x: m(x.long())),
    "einsum_dense": (lambda: nn.Linear(4, 6), lambda m, x: m(x).view(-1, 2, 3)),
    "multi_head_attention": (lambda: Attention(6, 2, 3), plain),
    "lstm": (lambda: nn.LSTM(3, 5, batch_first=True), rnn),
    "gru": (lambda: nn.GRU(3, 4, batch_first=True), rnn),
    "simple_rnn": (lambda: nn.RNN(3, 4, batch_first=True), rnn),
}


def torch_twin(name, state):
    make_module, forward = TWINS[name]
    twin = Twin(make_module(), forward)
    twin.load_state_dict({k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}, strict=True)
    return twin.eval()


class SlimTwin(nn.Module):
    """test_export_layouts.slim_net in torch.nn."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.conv1.BatchNorm = nn.BatchNorm2d(4, eps=1e-3)
        self.dw = nn.Conv2d(4, 8, 3, padding=1, groups=4)
        self.sep = Separable(8, 1, 5, 3)
        self.sep.depthwise.padding = (1, 1)

    def forward(self, x):
        x = torch.relu(self.conv1.BatchNorm(self.conv1(x)))
        return torch.relu(self.sep(torch.relu(self.dw(x))))
