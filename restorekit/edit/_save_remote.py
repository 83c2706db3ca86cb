"""Saving an edited checkpoint to ``gs://`` and other remote filesystems: shard by shard (TF), or write locally and upload."""

from __future__ import annotations

import os
import tempfile

from restorekit._bundle import files, statefile
from restorekit.errors import OutputError, OutputExistsError


def save_remote(out: str, *, source_prefix: str, write_local, format: str, overwrite: bool,
                update_state_file: bool) -> str:
    """Save to the remote ``out``; refuse an existing output first.

    ``write_local(path)`` writes the output at ``path``. A TF checkpoint gets the remote
    prefix itself: ``save_tf`` stages one shard at a time under ``$TMPDIR`` and uploads
    each as soon as it is complete, reused source shards straight from the source, the
    ``.index`` last (``files.RemoteStaging``), so the local disk never holds more than
    one shard. Other formats are one file, written under a local directory and then
    uploaded. Each upload goes to a hidden name and is renamed, so the checkpoint
    exists for readers only once it is complete. An existing remote checkpoint is not
    replaced: that would briefly mix old and new files, which no object store can
    rename as one.
    """
    target = _target(out, source_prefix, format)
    if files.exists(target + ".index" if format == "tf" else target):
        if overwrite:
            raise OutputError(
                f"{target!r} exists on a remote filesystem, where replacing it cannot be atomic; "
                "delete it first or save under a new name"
            )
        raise OutputExistsError(path=target)
    if format == "tf":
        write_local(target)
    else:
        with tempfile.TemporaryDirectory(prefix="restorekit-upload-") as local_dir:
            local = os.path.join(local_dir, files.basename(target))
            write_local(local)
            files.publish(local, target, overwrite=False)
    if update_state_file and format == "tf":
        statefile.write(target)
    return target


def _target(out: str, source_prefix: str, format: str) -> str:
    target = out[: -len(".index")] if format == "tf" and out.endswith(".index") else out.rstrip("/")
    # (ram:// calls any prefix of a file a directory, so a checkpoint's own prefix is not one)
    if format == "tf" and files.isdir(target) and not files.exists(target + ".index"):
        target = files.join(target, os.path.basename(source_prefix))
    if format == "tf" and target == source_prefix:
        raise OutputExistsError(path=out, is_source=True)
    return target
