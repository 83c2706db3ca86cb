"""Saving an edited checkpoint to ``gs://`` and other remote filesystems: write locally, then upload file by file."""

from __future__ import annotations

import os
import tempfile

from restorekit.bundle import files, statefile
from restorekit.errors import OutputError, OutputExistsError


def save_remote(out: str, *, source_prefix: str, write_local, format: str, overwrite: bool,
                update_state_file: bool) -> str:
    """Save to ``out`` through a local directory under ``$TMPDIR``.

    ``write_local(path)`` writes the output at the local ``path`` (a TF prefix, or a
    file for other formats). Each file is uploaded under a hidden name and renamed;
    the data shards go first and the ``.index`` last, so the checkpoint exists for
    readers only once it is complete. An existing remote checkpoint is not replaced:
    that would briefly mix old and new files, which no object store can rename as one.
    """
    target = _target(out, source_prefix, format)
    if files.exists(target + ".index" if format == "tf" else target):
        if overwrite:
            raise OutputError(
                f"{target!r} exists on a remote filesystem, where replacing it cannot be atomic; "
                "delete it first or save under a new name"
            )
        raise OutputExistsError(path=target)
    base = files.basename(target)
    directory = files.dirname(target)
    with tempfile.TemporaryDirectory(prefix="restorekit-upload-") as local_dir:
        write_local(os.path.join(local_dir, base))
        if format == "tf":
            shards = sorted(n for n in os.listdir(local_dir) if n.startswith(base + ".data-"))
            names = shards + [base + ".index"]
        else:
            names = [base]
        _upload(local_dir, directory, names)
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


def _upload(local_dir: str, directory: str, names: list[str]) -> None:
    """Publish ``names`` in order; on failure remove the ones already uploaded."""
    uploaded = []
    try:
        for name in names:
            # data shards without their index are orphans of an earlier failed save
            files.publish(os.path.join(local_dir, name), files.join(directory, name), overwrite=name != names[-1])
            uploaded.append(name)
    except BaseException:
        for name in uploaded:
            files.remove(files.join(directory, name))
        raise
