"""The one place restorekit imports TensorFlow: lazily, with a clear error when it is missing."""

import contextlib
import os
import sys

from restorekit.errors import MissingDependencyError

__all__ = ["import_tensorflow", "quiet_logs"]

_quiet = False


def quiet_logs() -> None:
    """Keep TensorFlow's C++ log lines (oneDNN, CUDA probes) off the terminal: the CLI's one-line promise.

    Sets ``TF_CPP_MIN_LOG_LEVEL=3`` unless the user chose a level, and makes the first
    ``import_tensorflow`` send the native stderr to /dev/null while TensorFlow loads:
    the lines printed before absl's logging starts ignore the level.
    """
    global _quiet
    _quiet = True
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


@contextlib.contextmanager
def native_stderr_silenced():
    try:
        saved = os.dup(2)
    except OSError:  # no fd 2 (an embedded interpreter): nothing to silence
        yield
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        sys.stderr.flush()
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def import_tensorflow():
    """The ``tensorflow`` module.

    TensorFlow is an optional dependency (users bring ``tensorflow``, ``tensorflow-cpu``
    or a nightly), so functions that build or run TF objects import it here.

    Raises:
        MissingDependencyError: TensorFlow is not installed.
    """
    try:
        if _quiet and "tensorflow" not in sys.modules:
            with native_stderr_silenced():
                import tensorflow
        else:
            import tensorflow
    except ModuleNotFoundError as e:
        if e.name != "tensorflow":
            raise
        raise MissingDependencyError(
            "this needs TensorFlow, which is not installed: pip install 'restorekit[tf]' "
            "(or 'restorekit[tf-cpu]', or keep the TensorFlow build you already use)"
        ) from None
    return tensorflow
