"""restorekit: restore TensorFlow checkpoints partially, fine-tune from them, operate on them.

``import restorekit`` is cheap: TensorFlow, torch and safetensors load only inside the
functions that need them.
"""

from restorekit.checkpoint import Checkpoint, Entry, RestoreKitWarning
from restorekit.errors import (
    AssignmentMapError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    EditError,
    GraphError,
    GraphTooLargeError,
    GroupError,
    IncompleteRestoreError,
    InsufficientSpaceError,
    InvalidArgumentError,
    MissingDependencyError,
    NameCollisionError,
    NoMatchError,
    OutputError,
    OutputExistsError,
    RestoreKitError,
    VocabularyError,
)
from restorekit.initializers import initialize_uninitialized, uninitialized_initializer
from restorekit.report import Record, RestoreReport
from restorekit.restore import assign_from_checkpoint_fn, partial_saver, warm_start
from restorekit.scaffold import easy_going_scaffold
from restorekit.scan import scan

__version__ = "0.1.0"

__all__ = [
    "AssignmentMapError",
    "Checkpoint",
    "CheckpointNotFoundError",
    "ChecksumMismatchError",
    "CorruptCheckpointError",
    "EditError",
    "Entry",
    "GraphError",
    "GraphTooLargeError",
    "GroupError",
    "IncompleteRestoreError",
    "InsufficientSpaceError",
    "InvalidArgumentError",
    "MissingDependencyError",
    "NameCollisionError",
    "NoMatchError",
    "OutputError",
    "OutputExistsError",
    "Record",
    "RestoreKitError",
    "RestoreKitWarning",
    "RestoreReport",
    "VocabularyError",
    "assign_from_checkpoint_fn",
    "easy_going_scaffold",
    "initialize_uninitialized",
    "partial_saver",
    "scan",
    "uninitialized_initializer",
    "warm_start",
]
