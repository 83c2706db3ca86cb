"""restorekit: restore TensorFlow checkpoints partially, fine-tune from them, operate on them.

``import restorekit`` is cheap: TensorFlow, torch and safetensors load only inside the
functions that need them.
"""

from restorekit._averaging import AverageResult, average, interpolate
from restorekit._merging import MergeRecipe, MergeResult, merge
from restorekit._checkpoint import Checkpoint, Entry, Problem, VerifyResult
from restorekit._compare import diff_checkpoints, tensor_stats
from restorekit.edit import CheckpointEditor
from restorekit.errors import (
    AssignmentMapError,
    CheckpointChangedError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CompressionError,
    CorruptCheckpointError,
    EditError,
    ExternalDataError,
    EntryNotFoundError,
    GraphError,
    GraphTooLargeError,
    GroupError,
    IncompleteRestoreError,
    InsufficientSpaceError,
    InvalidArgumentError,
    MissingDependencyError,
    NameCollisionError,
    NoMatchError,
    OptionNotApplicableError,
    OutputError,
    OutputExistsError,
    OutputNameError,
    RankFailedError,
    RestoreKitError,
    RestoreKitWarning,
    SourceMismatchError,
    RunDirectoryError,
    UnknownFormatError,
    UnknownVariableError,
    VocabularyError,
    WriteFailedError,
)
# compress imports TensorFlow and LiteRT only inside its functions, so this import stays cheap;
# importing it here (not on first use) keeps `restorekit.compress` the function, never the module.
from restorekit.compress import CompressResult, compress
from restorekit.export import ExportResult, convert, export_checkpoint, import_checkpoint
from restorekit.finetune import (
    VariableGroup,
    VariableGroups,
    group_variables,
    grouped_keras_optimizer,
    grouped_optax,
    layerwise_decay,
    optax_partitions,
    param_groups,
    scale_gradients,
)
from restorekit.graph import (
    Alignment,
    ConvertedConstant,
    GraphSummary,
    TensorSummary,
    UnfreezeResult,
    VariableSummary,
    freeze,
    import_meta_graph,
    inspect_graph,
    repair_graph,
    unfreeze,
)
from restorekit._lora import LoraExportResult, LoraMergeResult, export_lora_adapter, merge_lora
from restorekit._initializers import initialize_uninitialized, uninitialized_initializer
from restorekit._report import Record, RestoreReport
from restorekit._scaffold import easy_going_scaffold
from restorekit import rules  # noqa: F401  (restorekit.rules.KERAS_FROM_TF1)
from restorekit._policies import AdaptInputChannels, ResizePositions, VocabRemap
from restorekit import formats  # noqa: F401  (restorekit.formats.open(path): every readable format, one Source)
from restorekit.rules import FLAX_FROM_TF, KERAS_FROM_KERAS2, KERAS_FROM_TF1, Rules
from restorekit._scan import scan
from restorekit._sources import From
from restorekit._tf1 import assign_from_checkpoint_fn, partial_saver, source_savers, warm_start
from restorekit._tf2 import restore
from restorekit._optim._tf1_target import tf1_training

__version__ = "0.1.0"


def __getattr__(name: str):
    # GroupedOptimizer subclasses TF's Optimizer, so it is made on first use;
    # importing it eagerly would import TensorFlow with restorekit.
    if name == "GroupedOptimizer":
        from restorekit import finetune

        return finetune.GroupedOptimizer
    # resume_or_warm_start and WarmStart (a keras Callback) live in a module that imports Keras.
    if name in ("resume_or_warm_start", "WarmStart"):
        from restorekit import _resume as resume

        return getattr(resume, name)
    raise AttributeError(f"module 'restorekit' has no attribute {name!r}")


__all__ = [
    "FLAX_FROM_TF",
    "KERAS_FROM_KERAS2",
    "KERAS_FROM_TF1",
    "AdaptInputChannels",
    "Alignment",
    "AssignmentMapError",
    "AverageResult",
    "Checkpoint",
    "CheckpointEditor",
    "CheckpointChangedError",
    "CheckpointNotFoundError",
    "ChecksumMismatchError",
    "CompressResult",
    "CompressionError",
    "ConvertedConstant",
    "CorruptCheckpointError",
    "EditError",
    "Entry",
    "From",
    "EntryNotFoundError",
    "ExportResult",
    "ExternalDataError",
    "GraphError",
    "GraphSummary",
    "GraphTooLargeError",
    "GroupError",
    "GroupedOptimizer",
    "IncompleteRestoreError",
    "LoraExportResult",
    "LoraMergeResult",
    "InsufficientSpaceError",
    "InvalidArgumentError",
    "MergeRecipe",
    "MergeResult",
    "MissingDependencyError",
    "NameCollisionError",
    "NoMatchError",
    "OptionNotApplicableError",
    "OutputError",
    "OutputExistsError",
    "OutputNameError",
    "Problem",
    "Record",
    "RestoreKitError",
    "RestoreKitWarning",
    "ResizePositions",
    "RestoreReport",
    "Rules",
    "SourceMismatchError",
    "RankFailedError",
    "RunDirectoryError",
    "TensorSummary",
    "UnknownFormatError",
    "UnknownVariableError",
    "UnfreezeResult",
    "VariableGroup",
    "VariableGroups",
    "VariableSummary",
    "VerifyResult",
    "VocabRemap",
    "VocabularyError",
    "WriteFailedError",
    "WarmStart",
    "assign_from_checkpoint_fn",
    "average",
    "compress",
    "convert",
    "diff_checkpoints",
    "easy_going_scaffold",
    "export_checkpoint",
    "export_lora_adapter",
    "freeze",
    "group_variables",
    "grouped_keras_optimizer",
    "grouped_optax",
    "import_checkpoint",
    "initialize_uninitialized",
    "import_meta_graph",
    "inspect_graph",
    "interpolate",
    "merge",
    "layerwise_decay",
    "merge_lora",
    "optax_partitions",
    "param_groups",
    "partial_saver",
    "source_savers",
    "repair_graph",
    "restore",
    "resume_or_warm_start",
    "scale_gradients",
    "scan",
    "tf1_training",
    "tensor_stats",
    "unfreeze",
    "uninitialized_initializer",
    "warm_start",
]
