"""Hide TensorFlow from a process, as on a machine where it is not installed (issue 24).

The backend tests put this directory first on a subprocess's PYTHONPATH: every import
finder is wrapped so that nothing named ``tensorflow`` or ``tensorflow.*`` is found, so
``import tensorflow`` raises ``ModuleNotFoundError`` and ``importlib.util.find_spec``
returns None (libraries that probe for TensorFlow, as Keras and transformers do, still import).
"""

import sys


class _WithoutTensorFlow:
    """Finds what ``finder`` finds, except TensorFlow."""

    def __init__(self, finder):
        self._finder = finder

    def find_spec(self, name, path=None, target=None):
        if name == "tensorflow" or name.startswith("tensorflow.") or not hasattr(self._finder, "find_spec"):
            return None
        return self._finder.find_spec(name, path, target)

    def __getattr__(self, attr):  # invalidate_caches, find_distributions, ...
        return getattr(self._finder, attr)


sys.meta_path[:] = [_WithoutTensorFlow(finder) for finder in sys.meta_path]
