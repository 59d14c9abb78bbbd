"""The TensorFlow writer refuses a component whose shape differs from its variable's."""

from __future__ import annotations

import numpy as np
import pytest

from parallelvars.errors import InvalidEntryError
from parallelvars.formats import ArrayEntry, DictView, write_checkpoint


class _OwnShapes(ArrayEntry):
    """An entry that declares each component's own shape, the first one's as the variable's."""

    def component_shape(self, i: int) -> tuple[int, ...]:
        self._check_index(i)
        return tuple(self._components[i].shape)


@pytest.mark.parametrize("kind", ["mirrored", "independent"])
def test_component_of_another_shape_is_refused_with_the_variables_shape_expected(
    tmp_path, kind
) -> None:
    entry = _OwnShapes("v", [np.ones((2, 3), np.float32), np.ones((3, 2), np.float32)], kind=kind)
    views = DictView({"v": entry, "w": ArrayEntry("w", [np.ones(2)])})
    with pytest.raises(InvalidEntryError, match="component 1 has another shape") as err:
        write_checkpoint(tmp_path / "ckpt", views, format="tf")
    e = err.value
    assert e.file is not None and e.file.startswith(str(tmp_path))
    assert e.variable == "v"
    assert e.expected == (2, 3)  # the variable's shape
    assert e.found == (3, 2)  # the component's
    assert not list(tmp_path.glob("ckpt*"))
