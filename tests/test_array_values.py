"""restorekit._array_values: the numpy values the Keras-on-JAX/torch and torch-module restores assign."""

import numpy as np
import pytest

from restorekit._array_values import policy_value
from restorekit._policies import CAST, SLICE_OR_PAD, VocabRemap
from restorekit._report import Record


def _record(shape, dtype="float32", checkpoint_shape=None):
    return Record("v", "v", tuple(shape), dtype, tuple(checkpoint_shape or shape), "float32")


def test_vocab_remap_takes_old_rows_by_word_and_zeros_for_new_words_and_oov_buckets():
    old = np.arange(12, dtype="float32").reshape(3, 4)
    remap = VocabRemap(["a", "b", "c"], ["c", "x", "a"], num_oov_buckets=1)
    value = policy_value(remap, _record((4, 4), checkpoint_shape=(3, 4)), old, None, None)
    np.testing.assert_array_equal(value, np.stack([old[2], np.zeros(4), old[0], np.zeros(4)]))


def test_vocab_remap_on_columns_with_a_backup_initializer():
    old = np.arange(6, dtype="float32").reshape(2, 3)
    remap = VocabRemap(["a", "b", "c"], ["b", "z"], axis=1, backup_initializer=lambda shape, dtype: np.full(shape, 9.0))
    value = policy_value(remap, _record((2, 2), checkpoint_shape=(2, 3)), old, None, None)
    np.testing.assert_array_equal(value, [[1, 9], [4, 9]])


def test_slice_or_pad_keeps_the_variables_own_values_outside_the_checkpoints_block():
    current = np.full((3, 5), -1.0, "float32")
    value = policy_value(SLICE_OR_PAD, _record((3, 5), checkpoint_shape=(4, 2)), np.ones((4, 2), "float32"),
                         "handle", lambda handle: current)
    np.testing.assert_array_equal(value[:, :2], 1.0)
    np.testing.assert_array_equal(value[:, 2:], -1.0)
    assert value.dtype == np.float32


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"], ids=["to float16", "to bfloat16", "to float64"])
def test_cast_rounds_as_numpy_does(dtype):
    from restorekit._bundle.format import dtype_enum, numpy_dtype

    source = np.array([1.0, 1 / 3, 65504.0], "float32")
    value = policy_value(CAST, _record((3,), dtype), source, None, None)
    assert value.dtype == numpy_dtype(dtype_enum(dtype))
    np.testing.assert_array_equal(value, source.astype(numpy_dtype(dtype_enum(dtype))))


def test_a_callable_policy_gets_the_value_and_the_handle():
    seen = []
    value = policy_value(lambda v, h: seen.append(h) or v[:2] * 2, _record((2,), checkpoint_shape=(3,)),
                         np.array([1, 2, 3], "float32"), "the variable", None)
    np.testing.assert_array_equal(value, [2, 4])
    assert seen == ["the variable"]
