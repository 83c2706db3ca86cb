"""The one place restorekit imports TensorFlow: lazily, with a clear error when it is missing."""

from restorekit.errors import MissingDependencyError

__all__ = ["import_tensorflow"]


def import_tensorflow():
    """The ``tensorflow`` module.

    TensorFlow is an optional dependency (users bring ``tensorflow``, ``tensorflow-cpu``
    or a nightly), so functions that build or run TF objects import it here.

    Raises:
        MissingDependencyError: TensorFlow is not installed.
    """
    try:
        import tensorflow
    except ModuleNotFoundError as e:
        if e.name != "tensorflow":
            raise
        raise MissingDependencyError(
            "this needs TensorFlow, which is not installed: pip install 'restorekit[tf]' "
            "(or 'restorekit[tf-cpu]', or keep the TensorFlow build you already use)"
        ) from None
    return tensorflow
