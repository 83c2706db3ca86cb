"""resume_or_warm_start (custom loops) and WarmStart (model.fit): a run's own checkpoint wins over the pretrained one."""

import logging
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import restorekit
from restorekit.errors import CheckpointNotFoundError, CorruptCheckpointError
from restorekit._resume import Start

X = np.random.RandomState(0).randn(32, 4).astype("float32")
Y = np.random.RandomState(1).randn(32, 2).astype("float32")


def model_with(head="head", seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((4,))
    x = keras.layers.Dense(3, name="enc")(inputs)
    return keras.Model(inputs, keras.layers.Dense(2, name=head)(x), name="net")


@pytest.fixture
def pretrained(tmp_path):
    source = model_with(seed=1)
    path = str(tmp_path / "pretrained.weights.h5")
    source.save_weights(path)
    return source, path


def train_step(model, optimizer):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(X) - Y) ** 2)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))


# ---------------------------------------------------------------- custom loops

def test_fresh_run_warm_starts_then_a_restart_resumes_without_pretrained(tmp_path, pretrained, caplog):
    source, path = pretrained
    run = str(tmp_path / "run")
    model, optimizer = model_with("new_head", seed=2), keras.optimizers.Adam(0.01)
    with caplog.at_level(logging.INFO, logger="restorekit"):
        start = restorekit.resume_or_warm_start(run, path, model=model, optimizer=optimizer)
    assert start.how == "warm_started" and not start.resumed and start.checkpoint == path
    assert {r.variable_name for r in start.report.missing} == {"new_head/kernel", "new_head/bias"}
    np.testing.assert_array_equal(model.get_layer("enc").kernel.numpy(), source.get_layer("enc").kernel.numpy())
    assert "warm-started from" in caplog.text
    assert int(optimizer.iterations.numpy()) == 0  # the optimizer stays fresh

    manager = tf.train.CheckpointManager(tf.train.Checkpoint(model=model, optimizer=optimizer), run, max_to_keep=2)
    for _ in range(3):
        train_step(model, optimizer)
    manager.save()
    saved = {v.path: v.numpy() for v in model.weights}
    saved_slots = [v.numpy() for v in optimizer.variables]

    os.remove(path)  # the pretrained file is gone: a resume must not need it
    again, optimizer2 = model_with("new_head", seed=3), keras.optimizers.Adam(0.01)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="restorekit"):
        start = restorekit.resume_or_warm_start(run, path, model=again, optimizer=optimizer2)
    assert start.resumed and start.report is None and start.step == 3
    assert start.checkpoint == manager.latest_checkpoint and "resumed from" in caplog.text
    for v in again.weights:
        np.testing.assert_array_equal(v.numpy(), saved[v.path])
    optimizer2.build(again.trainable_variables)
    for a, b in zip(optimizer2.variables, saved_slots):
        np.testing.assert_array_equal(a.numpy(), b)


def test_step_variable_is_restored(tmp_path, pretrained):
    _, path = pretrained
    model, step = model_with(seed=4), tf.Variable(0, dtype=tf.int64)
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(model=model, step=step), str(tmp_path / "run"), 1)
    step.assign(41)
    manager.save()
    fresh_step = tf.Variable(0, dtype=tf.int64)
    start = restorekit.resume_or_warm_start(str(tmp_path / "run"), path, model=model_with(seed=5), step=fresh_step)
    assert start.resumed and start.step == 41 and int(fresh_step.numpy()) == 41


def test_restarts_through_the_manager_continue_the_checkpoint_numbering(tmp_path, pretrained):
    source, path = pretrained
    run = str(tmp_path / "run")
    enc_after = []
    for restart in range(3):
        model, optimizer = model_with("new_head", seed=10 + restart), keras.optimizers.Adam(0.01)
        step = tf.Variable(0, dtype=tf.int64)
        manager = tf.train.CheckpointManager(
            tf.train.Checkpoint(model=model, optimizer=optimizer, step=step), run, max_to_keep=3
        )
        start = restorekit.resume_or_warm_start(manager, path, model=model, optimizer=optimizer)
        if restart == 0:
            assert start.how == "warm_started"
            np.testing.assert_array_equal(model.get_layer("enc").kernel.numpy(), source.get_layer("enc").kernel.numpy())
        else:
            assert start.resumed and start.checkpoint == os.path.join(run, f"ckpt-{restart}")
            assert start.step == 2 * restart and int(step.numpy()) == 2 * restart
            np.testing.assert_array_equal(model.get_layer("enc").kernel.numpy(), enc_after[-1])
        for _ in range(2):
            train_step(model, optimizer)
            step.assign_add(1)
        assert manager.save() == os.path.join(run, f"ckpt-{restart + 1}")
        enc_after.append(model.get_layer("enc").kernel.numpy())
    assert [os.path.basename(p) for p in manager.checkpoints] == ["ckpt-1", "ckpt-2", "ckpt-3"]
    assert int(optimizer.iterations.numpy()) == 6


def test_under_mirrored_strategy(tmp_path, pretrained):
    source, path = pretrained
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1", "/cpu:2"])
    run = str(tmp_path / "run")
    with strategy.scope():
        model, optimizer = model_with(seed=6), keras.optimizers.SGD(0.1)
        start = restorekit.resume_or_warm_start(run, path, model=model, optimizer=optimizer)
    assert start.how == "warm_started"
    for replica in model.get_layer("head").kernel.value.values:
        np.testing.assert_array_equal(replica.numpy(), source.get_layer("head").kernel.numpy())
    tf.train.CheckpointManager(tf.train.Checkpoint(model=model, optimizer=optimizer), run, 1).save()
    with strategy.scope():
        again = model_with(seed=7)
        start = restorekit.resume_or_warm_start(run, path, model=again, optimizer=keras.optimizers.SGD(0.1))
    assert start.resumed
    for replica in again.get_layer("enc").kernel.value.values:
        np.testing.assert_array_equal(replica.numpy(), source.get_layer("enc").kernel.numpy())


def test_no_checkpoint_and_no_pretrained_is_an_error(tmp_path):
    with pytest.raises(CheckpointNotFoundError):
        restorekit.resume_or_warm_start(str(tmp_path / "run"), str(tmp_path / "gone.weights.h5"), model=model_with())


def test_strict_warm_start(tmp_path, pretrained):
    _, path = pretrained
    with pytest.raises(restorekit.IncompleteRestoreError):
        restorekit.resume_or_warm_start(str(tmp_path / "run"), path, model=model_with("new_head"), strict=True)


def test_start_is_a_frozen_value():
    start = Start("resumed", "run/ckpt-3", None, 3)
    with pytest.raises(AttributeError):
        start.how = "warm_started"
    assert "resumed from 'run/ckpt-3' at step 3" in str(start)


# ---------------------------------------------------------------- model.fit

def compiled(head="new_head", seed=10):
    model = model_with(head, seed)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model


class Interrupt(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1:
            raise KeyboardInterrupt


@pytest.mark.parametrize("warm_first", [False, True], ids=["backup_first", "warm_start_first"])
def test_fit_warm_starts_once_then_resumes_from_the_backup(tmp_path, pretrained, capsys, warm_first):
    source, path = pretrained
    backup = str(tmp_path / "backup")
    model = compiled()
    seen = {}

    class Look(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen.setdefault("enc", self.model.get_layer("enc").kernel.numpy())

    def callbacks(extra):
        pair = [keras.callbacks.BackupAndRestore(backup), restorekit.WarmStart(path, backup_dir=backup)]
        return (pair[::-1] if warm_first else pair) + [Look()] + extra

    with pytest.raises(KeyboardInterrupt):
        model.fit(X, Y, epochs=4, batch_size=8, verbose=0, callbacks=callbacks([Interrupt()]))
    np.testing.assert_array_equal(seen["enc"], source.get_layer("enc").kernel.numpy())  # before the first batch
    out = capsys.readouterr().out
    assert out.count("warm-started from") == 1 and "matched" in out
    interrupted = {v.path: v.numpy() for v in model.weights}

    os.remove(path)  # a restart must not need it
    restarted, seen = compiled(seed=11), {}
    warm = restorekit.WarmStart(path, backup_dir=backup)
    pair = [keras.callbacks.BackupAndRestore(backup), warm]
    history = restarted.fit(X, Y, epochs=4, batch_size=8, verbose=0,
                            callbacks=(pair[::-1] if warm_first else pair) + [Look()])
    assert warm.start.resumed and warm.start.report is None
    assert len(history.epoch) == 2  # epochs 2 and 3: the backup's epoch count was restored
    np.testing.assert_array_equal(seen["enc"], interrupted["enc/kernel"])  # the backup's weights, not pretrained
    out = capsys.readouterr().out
    assert "resumed from backup" in out and "warm-started" not in out


def test_fit_twice_warm_starts_once(tmp_path, pretrained, capsys, caplog):
    _, path = pretrained
    model, warm = compiled(), restorekit.WarmStart(path, verbose=0)
    with caplog.at_level(logging.INFO, logger="restorekit"):
        model.fit(X, Y, epochs=1, verbose=0, callbacks=[warm])
        trained = model.get_layer("enc").kernel.numpy()
        seen = []

        class Look(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                seen.append(self.model.get_layer("enc").kernel.numpy())

        model.fit(X, Y, epochs=1, verbose=0, callbacks=[warm, Look()])
    np.testing.assert_array_equal(seen[0], trained)  # the second fit goes on from the first
    assert warm.start.how == "warm_started" and capsys.readouterr().out == ""
    assert caplog.text.count("warm-started from") == 1


def test_warm_start_with_neither_pretrained_nor_backup(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="WarmStart cannot start.*holds no backup") as info:
        restorekit.WarmStart(str(tmp_path / "gone.weights.h5"), backup_dir=str(tmp_path / "backup"))
    assert "backup_dir of a run to resume" in str(info.value)
    (tmp_path / "bad.weights.h5").write_bytes(b"garbage")
    with pytest.raises(CorruptCheckpointError, match="no backup_dir was given"):
        restorekit.WarmStart(str(tmp_path / "bad.weights.h5"))
    assert sorted(os.listdir(tmp_path)) == ["bad.weights.h5"]


# ---------------------------------------------------------------- which checkpoint a restart resumes from

def saved_run(run: str, saves: int = 2):
    """A run of ``saves`` manager saves (``ckpt-1``...), one training step apart; the enc kernel after each."""
    model, optimizer = model_with(seed=20), keras.optimizers.Adam(0.01)
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(model=model, optimizer=optimizer), run, max_to_keep=5)
    kernels = []
    for _ in range(saves):
        train_step(model, optimizer)
        manager.save()
        kernels.append(model.get_layer("enc").kernel.numpy())
    return kernels


def restarted(run: str):
    model, optimizer = model_with(seed=21), keras.optimizers.Adam(0.01)
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(model=model, optimizer=optimizer), run, max_to_keep=5)
    return model, optimizer, manager


def file_bytes(directory: str) -> dict:
    return {name: open(os.path.join(directory, name), "rb").read() for name in sorted(os.listdir(directory))}


def test_a_state_file_naming_a_vanished_checkpoint_resumes_from_the_newest_intact_one(tmp_path, pretrained):
    _, path = pretrained
    run = str(tmp_path / "run")
    kernels = saved_run(run)
    # the state file names ckpt-9, whose files are gone; ckpt-1 and ckpt-2 are intact
    tf.compat.v1.train.update_checkpoint_state(run, os.path.join(run, "ckpt-9"), all_model_checkpoint_paths=[
        os.path.join(run, f"ckpt-{n}") for n in (1, 2, 9)])
    ckpt_1 = {k: v for k, v in file_bytes(run).items() if k.startswith("ckpt-1.")}
    model, optimizer, manager = restarted(run)
    with pytest.warns(restorekit.RestoreKitWarning, match=r"(?s)from '.*ckpt-2'.*ckpt-9'.*missing"):
        start = restorekit.resume_or_warm_start(manager, path, model=model, optimizer=optimizer)
    assert start.resumed and start.checkpoint == os.path.join(run, "ckpt-2") and start.step == 2
    np.testing.assert_array_equal(model.get_layer("enc").kernel.numpy(), kernels[1])
    # the numbering goes on from ckpt-2: the next save is ckpt-3, and ckpt-1 is untouched
    assert manager.save() == os.path.join(run, "ckpt-3")
    assert {k: v for k, v in file_bytes(run).items() if k.startswith("ckpt-1.")} == ckpt_1


def test_a_lost_state_file_resumes_from_the_newest_checkpoint_in_the_directory(tmp_path, pretrained):
    _, path = pretrained
    run = str(tmp_path / "run")
    kernels = saved_run(run)
    os.remove(os.path.join(run, "checkpoint"))
    model, optimizer, manager = restarted(run)
    with pytest.warns(restorekit.RestoreKitWarning, match="state file .* is missing; resuming from '.*ckpt-2'"):
        start = restorekit.resume_or_warm_start(manager, path, model=model, optimizer=optimizer)
    assert start.resumed and start.checkpoint == os.path.join(run, "ckpt-2")
    np.testing.assert_array_equal(model.get_layer("enc").kernel.numpy(), kernels[1])
    assert manager.save() == os.path.join(run, "ckpt-3")


def truncate(path: str, keep: float = 0.5) -> None:
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: int(len(data) * keep)])


def flip_last_byte(path: str) -> None:
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 0xFF
    with open(path, "wb") as f:
        f.write(bytes(data))


DAMAGE = {
    "truncated-index": ("ckpt-2.index", truncate, "unreadable"),
    "truncated-data": ("ckpt-2.data-00000-of-00001", truncate, "truncated"),
    "flipped-data-byte": ("ckpt-2.data-00000-of-00001", flip_last_byte, "crc32c"),
}


@pytest.mark.parametrize("damage", list(DAMAGE), ids=list(DAMAGE))
def test_a_damaged_latest_checkpoint_is_skipped_with_a_warning(tmp_path, pretrained, damage):
    _, path = pretrained
    run = str(tmp_path / "run")
    kernels = saved_run(run)
    name, harm, why = DAMAGE[damage]
    harm(os.path.join(run, name))
    model, optimizer, manager = restarted(run)
    with pytest.warns(restorekit.RestoreKitWarning, match=rf"(?s)from '.*ckpt-1'.*ckpt-2'.*{why}"):
        start = restorekit.resume_or_warm_start(run, path, model=model, optimizer=optimizer)
    assert start.resumed and start.checkpoint == os.path.join(run, "ckpt-1") and start.step == 1
    np.testing.assert_array_equal(model.get_layer("enc").kernel.numpy(), kernels[0])


def test_no_readable_checkpoint_is_an_error_and_nothing_is_warm_started_or_written(tmp_path, pretrained):
    _, path = pretrained
    run = str(tmp_path / "run")
    saved_run(run, saves=1)
    truncate(os.path.join(run, "ckpt-1.data-00000-of-00001"))
    before = file_bytes(run)
    model, optimizer, manager = restarted(run)
    untouched = model.get_layer("enc").kernel.numpy()
    with pytest.raises(restorekit.RunDirectoryError, match=r"(?s)none is complete and readable.*ckpt-1.*truncated") as e:
        restorekit.resume_or_warm_start(manager, path, model=model, optimizer=optimizer)
    assert [p for p, _ in e.value.skipped] == [os.path.join(run, "ckpt-1")] and e.value.directory == run
    np.testing.assert_array_equal(model.get_layer("enc").kernel.numpy(), untouched)  # not warm-started
    assert file_bytes(run) == before


@pytest.mark.parametrize("where", ["relative", "absolute"], ids=["dot-dot-other-run", "absolute-path-elsewhere"])
def test_a_state_file_naming_another_directory_is_refused_by_name(tmp_path, pretrained, where):
    _, path = pretrained
    other, run = str(tmp_path / "other"), str(tmp_path / "run")
    saved_run(other, saves=1)
    os.makedirs(run)
    named = "../other/ckpt-1" if where == "relative" else os.path.join(other, "ckpt-1")
    with open(os.path.join(run, "checkpoint"), "w") as f:
        f.write(f'model_checkpoint_path: "{named}"\nall_model_checkpoint_paths: "{named}"\n')
    before = file_bytes(run)
    model, optimizer, _ = restarted(run)
    untouched = model.get_layer("enc").kernel.numpy()
    with pytest.raises(restorekit.RunDirectoryError, match=r"(?s)names '.*other/ckpt-1', outside that directory"):
        restorekit.resume_or_warm_start(run, path, model=model, optimizer=optimizer)
    np.testing.assert_array_equal(model.get_layer("enc").kernel.numpy(), untouched)
    assert file_bytes(run) == before


# ---------------------------------------------------------------- what Keras' BackupAndRestore resumes from

def interrupted_backup(tmp_path, path):
    """A fit with BackupAndRestore(double_checkpoint=True) interrupted after epoch 1: latest + .bkp (epoch 0)."""
    backup = str(tmp_path / "backup")
    model = compiled()
    with pytest.raises(KeyboardInterrupt):
        model.fit(X, Y, epochs=4, batch_size=8, verbose=0, callbacks=[
            keras.callbacks.BackupAndRestore(backup, double_checkpoint=True), restorekit.WarmStart(path, verbose=0),
            Interrupt()])
    assert sorted(os.listdir(backup)) == ["latest.weights.h5", "latest.weights.h5.bkp", "training_metadata.json",
                                          "training_metadata.json.bkp"]
    previous = compiled(seed=30)
    copy = str(tmp_path / "previous.weights.h5")
    with open(os.path.join(backup, "latest.weights.h5.bkp"), "rb") as src, open(copy, "wb") as dst:
        dst.write(src.read())
    previous.load_weights(copy)
    return backup, previous.get_layer("enc").kernel.numpy()


def restart_fit(backup, path, warm_first, seed=31):
    model, seen = compiled(seed=seed), {}

    class Look(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen.setdefault("enc", self.model.get_layer("enc").kernel.numpy())

    warm = restorekit.WarmStart(path, backup_dir=backup, verbose=0)
    pair = [keras.callbacks.BackupAndRestore(backup, double_checkpoint=True), warm]
    model.fit(X, Y, epochs=4, batch_size=8, verbose=0, callbacks=(pair[::-1] if warm_first else pair) + [Look()])
    return warm.start, seen["enc"]


@pytest.mark.parametrize("warm_first", [False, True], ids=["backup_first", "warm_start_first"])
def test_a_lone_bkp_is_not_a_backup_keras_resumes_from_so_the_run_warm_starts(tmp_path, pretrained, warm_first):
    source, path = pretrained
    backup, _ = interrupted_backup(tmp_path, path)
    os.remove(os.path.join(backup, "latest.weights.h5"))  # Keras loads the .bkp only when this fails to load
    start, enc = restart_fit(backup, path, warm_first)
    assert start.how == "warm_started"
    np.testing.assert_array_equal(enc, source.get_layer("enc").kernel.numpy())  # not random weights


@pytest.mark.parametrize("warm_first", [False, True], ids=["backup_first", "warm_start_first"])
def test_a_damaged_latest_backup_resumes_from_the_bkp_as_keras_does(tmp_path, pretrained, warm_first):
    _, path = pretrained
    backup, previous_enc = interrupted_backup(tmp_path, path)
    truncate(os.path.join(backup, "latest.weights.h5"), keep=0.3)
    start, enc = restart_fit(backup, path, warm_first)
    # BackupAndRestore, when it runs first, has already copied the .bkp over latest.weights.h5
    named = "latest.weights.h5.bkp" if warm_first else "latest.weights.h5"
    assert start.resumed and start.checkpoint == os.path.join(backup, named)
    np.testing.assert_array_equal(enc, previous_enc)  # Keras loaded the .bkp


def test_a_damaged_latest_backup_without_bkp_is_a_clear_error(tmp_path, pretrained):
    _, path = pretrained
    backup = tmp_path / "backup"
    backup.mkdir()
    (backup / "latest.weights.h5").write_bytes(b"\x89HDF\r\n\x1a\n" + b"\0" * 64)
    with pytest.raises(CorruptCheckpointError, match=r"latest.weights.h5' is not a readable HDF5 file.*no "
                                                     r"'latest.weights.h5.bkp'"):
        restorekit.WarmStart(path, backup_dir=str(backup))
    assert sorted(os.listdir(backup)) == ["latest.weights.h5"]


def test_a_state_file_that_does_not_parse_resumes_from_the_newest_checkpoint(tmp_path, pretrained):
    _, path = pretrained
    run = str(tmp_path / "run")
    kernels = saved_run(run)
    with open(os.path.join(run, "checkpoint"), "wb") as f:
        f.write(b"\xff\xfe\x00garbage")  # tf.train.latest_checkpoint raises UnicodeDecodeError here
    model, optimizer = model_with(seed=22), keras.optimizers.Adam(0.01)
    with pytest.warns(restorekit.RestoreKitWarning, match="names no checkpoint .*resuming from '.*ckpt-2'"):
        start = restorekit.resume_or_warm_start(run, path, model=model, optimizer=optimizer)
    assert start.resumed and start.checkpoint == os.path.join(run, "ckpt-2")
    np.testing.assert_array_equal(model.get_layer("enc").kernel.numpy(), kernels[1])
