"""Hide torch, to run the test suite as on a machine without the optional torch extra (issue 20).

CI puts this directory first on PYTHONPATH for one run: torch stays installed, but every
import finder is wrapped so that nothing named ``torch`` or ``torch.*`` is found.
``import torch`` then raises ``ModuleNotFoundError: No module named 'torch'`` and
``importlib.util.find_spec('torch')`` returns None, exactly as without torch, so libraries
that probe for it (transformers) still import. Raising ImportError from a finder instead
would break ``import transformers``, which calls find_spec. Child processes that inherit
PYTHONPATH are covered too.
"""

import sys


class _WithoutTorch:
    """Finds what ``finder`` finds, except torch."""

    def __init__(self, finder):
        self._finder = finder

    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch.") or not hasattr(self._finder, "find_spec"):
            return None
        return self._finder.find_spec(name, path, target)

    def __getattr__(self, attr):  # invalidate_caches, find_distributions, ...
        return getattr(self._finder, attr)


sys.meta_path[:] = [_WithoutTorch(finder) for finder in sys.meta_path]
