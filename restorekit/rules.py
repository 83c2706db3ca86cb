"""Ready naming rule sets for scan(rules=...) and assignment_map=, such as KERAS_FROM_TF1."""

from restorekit.tf2 import KERAS_FROM_TF1, Rules

__all__ = ["KERAS_FROM_TF1", "Rules"]
