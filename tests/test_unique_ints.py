"""``unique_ints``: ``np.unique`` of an integer array (values, inverse, counts) from one stable
sort, without the ``numpy.ma`` import ``np.unique`` costs a process on its first call; and no
command's path imports ``numpy.ma`` through it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from parallelvars.testing import unique_ints


@given(
    hnp.arrays(
        st.sampled_from([np.int64, np.int32, np.uint8, np.intp]),
        st.integers(0, 200),
        elements=st.integers(0, 40),
    )
)
def test_unique_ints_is_np_unique(a: np.ndarray) -> None:
    values, inverse, counts = unique_ints(a)
    want_values, want_inverse, want_counts = np.unique(a, return_inverse=True, return_counts=True)
    assert values.dtype == a.dtype
    np.testing.assert_array_equal(values, want_values)
    np.testing.assert_array_equal(inverse, want_inverse.reshape(-1))
    np.testing.assert_array_equal(counts, want_counts)
    np.testing.assert_array_equal(values[inverse], a)


def test_negative_and_wide_values() -> None:
    a = np.array([5, -3, 2**62, -3, 0, 5, 5], np.int64)
    values, inverse, counts = unique_ints(a)
    assert values.tolist() == [-3, 0, 5, 2**62]
    assert counts.tolist() == [2, 1, 3, 1]
    np.testing.assert_array_equal(values[inverse], a)


def test_the_checkpoint_paths_do_not_import_numpy_ma(tmp_path: object) -> None:
    # Writing and reading an HDF5 checkpoint (the index's lookup3 checksums of spans of
    # several lengths, its columns of shapes of several ranks): np.unique imported numpy.ma
    # (tens of ms) on the way.
    code = textwrap.dedent(
        f"""
        import sys
        import numpy as np
        from parallelvars.checkpoint.h5raw.lookup3 import lookup3_many
        from parallelvars.formats import DictView, open_checkpoint, write_checkpoint
        from parallelvars.checkpoint.entry import ArrayEntry

        image = np.arange(4096, dtype=np.uint8)
        lookup3_many(image, [(0, 10), (0, 500), (3, 40), (7, 3000)])
        entries = [ArrayEntry(f"v{{i}}", [np.zeros((2,) * i, np.float32)]) for i in range(4)]
        path = write_checkpoint({str(tmp_path)!r} + "/c.h5", DictView(entries), format="hdf5")
        with open_checkpoint(path) as view:
            [view[k].value() for k in view]
        print("numpy.ma" in sys.modules)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "False", out.stdout + out.stderr
