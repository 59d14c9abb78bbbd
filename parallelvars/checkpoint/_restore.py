"""How a parallel variable saves, and the rules for restoring it onto M devices.

N is the number of components in the file, M the number of the live variable.

=============  ===============================================================================
live kind      what it receives
=============  ===============================================================================
single         the logical value (mirrored: primary; on-read: aggregate; sharded: full value)
mirrored       component-wise when the file has a mirrored variable of N == M components,
               else the logical value on every component
on_read        component-wise when the file has an on-read variable of N == M components and
               the same aggregation; else SUM: the total in the primary and zeros elsewhere
               (exact for every dtype), MEAN / ONLY_FIRST_REPLICA: the value on every component
independent   component-wise; only from the same number of components (else DeviceCountError)
sharded       the full value, re-split by the live variable's own shards (reads go straight
               into the right rows, so re-sharding costs nothing extra)
=============  ===============================================================================

An independent-buffers variable in the file has no single logical value, so it restores only
onto a variable with the same number of components, or onto a plain (single) variable, which
receives component 0 (saved under the plain key for that reason, as in the seed
parallel_device_saving); the other components are then reported unmatched by the load status
(``assert_consumed()`` fails, ``expect_partial()`` accepts it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from parallelvars._dtypes import dtype_name
from parallelvars.checkpoint.registry import Saveable, SaveRecord, component_name, register_saveable
from parallelvars.errors import DeviceCountError, DtypeMismatchError, ShapeMismatchError
from parallelvars.variables import ParallelVariable, ShardedVariable, aggregate_parts

__all__ = ["ParallelVariableSaveable", "read_logical_into"]


def _shard_slices(stored: Any) -> list[tuple[Any, ...]]:
    axis = int(stored.attrs["shard_axis"])
    out = []
    for i, start in enumerate(stored.attrs["shard_offsets"]):
        index: list[Any] = [slice(None)] * len(stored.shape)
        size = stored.component_shape(i)[axis]
        index[axis] = slice(int(start), int(start) + size)
        out.append(tuple(index))
    return out


def read_logical_into(stored: Any, out: np.ndarray, *, file: str, cast: bool) -> None:
    """Read the logical value of ``stored`` into ``out`` (checksums verified by the reader)."""
    kind = stored.kind
    n = stored.num_components
    if kind == "sharded":
        for i, index in enumerate(_shard_slices(stored)):
            stored.read_component_into(i, out[index], cast=cast)
        return
    if kind == "on_read" and n > 1:
        stored.read_component_into(0, out, cast=cast)

        def rest() -> Iterator[np.ndarray]:
            scratch = np.empty_like(out)
            for i in range(1, n):
                stored.read_component_into(i, scratch, cast=cast)
                yield scratch

        aggregate_parts(out, rest(), n, str(stored.attrs.get("aggregation", "sum")))
        return
    if kind == "independent" and n > 1:
        raise DeviceCountError(
            "independent buffers restore only onto the same number of devices",
            file=file,
            variable=stored.path,
            expected=f"{n} components",
            found="a single value",
        )
    stored.read_component_into(0, out, cast=cast)


# The most bytes read up front to check that a counter's saved values convert exactly.
_EXACT_CHECK_BYTES = 1 << 16


def _exactly_representable(stored: Any, dtype: np.dtype) -> bool:
    """Whether every saved component of ``stored`` converts to ``dtype`` and back unchanged.

    For an optimizer's non-slot counters (a step count, beta powers), which are scalars: a
    TensorFlow checkpoint keeps beta powers in float32, ours are float64; a value that converts
    exactly is taken without ``allow_cast``. Larger values are not checked (not exact).
    """
    if stored.dtype.kind not in "biuf" or np.dtype(dtype).kind not in "biuf":
        return False
    if stored.nbytes > _EXACT_CHECK_BYTES:
        return False
    for i in range(stored.num_components):
        saved = np.empty(stored.component_shape(i), stored.dtype)
        stored.read_component_into(i, saved)
        with np.errstate(all="ignore"):
            back = saved.astype(dtype).astype(stored.dtype)
        if not np.array_equal(back, saved, equal_nan=saved.dtype.kind == "f"):
            return False
    return True


class ParallelVariableSaveable(Saveable):
    """Saves ``primary`` and ``parallel_component_1..N-1``; restores by the table above."""

    def gather(self, obj: ParallelVariable) -> SaveRecord:
        attrs: dict[str, Any] = {
            "name": obj.name,
            "devices": list(obj.devices),
            "synchronization": obj.synchronization.value,
            "aggregation": obj.aggregation.value,
            "trainable": obj.trainable,
        }
        if isinstance(obj, ShardedVariable):
            attrs["shard_axis"] = obj.shard_axis
            attrs["shard_offsets"] = list(obj.shard_offsets)
        return SaveRecord(
            kind=obj.kind,
            components=obj.components,
            shape=tuple(obj.__wrapped__.shape),
            attrs=attrs,
        )

    def plan_restore(
        self, obj: ParallelVariable, stored: Any, *, file: str, path: str, allow_cast: bool
    ) -> Callable[[], None]:
        shape = tuple(obj.__wrapped__.shape)
        if tuple(stored.shape) != shape:
            raise ShapeMismatchError(
                "shape mismatch",
                file=file,
                variable=path,
                expected=shape,
                found=tuple(stored.shape),
            )
        cast = allow_cast
        if stored.dtype != obj.dtype and not allow_cast:
            if not (obj._self_exact_cast and _exactly_representable(stored, obj.dtype)):
                raise DtypeMismatchError(
                    "dtype mismatch"
                    + (" (values not exactly representable)" if obj._self_exact_cast else ""),
                    file=file,
                    variable=path,
                    expected=dtype_name(obj.dtype),
                    found=dtype_name(stored.dtype),
                    hint="restore with allow_cast=True to convert",
                )
            cast = True  # a counter whose saved values convert exactly (float32 beta powers)
        if stored.dtype != obj.dtype and (stored.dtype.kind == "O") != (obj.dtype.kind == "O"):
            raise DtypeMismatchError(
                "cannot cast between byte strings and numbers",
                file=file,
                variable=path,
                expected=dtype_name(obj.dtype),
                found=dtype_name(stored.dtype),
            )
        # m counts the whole variable's components; this process holds those of `indices`
        # (all of them, except under a multi-process strategy).
        m, n = obj.global_num_components, stored.num_components
        indices = obj.component_indices
        live, skind = obj.kind, stored.kind
        comps = obj.components
        if skind == "independent" and n > 1 and live == "single" and m == 1:
            # The seed (parallel_device_saving) saves component 0 under the plain key so that a
            # non-parallel variable restores from it; the other components stay unmatched.
            target = comps[0]

            def first_component() -> None:
                stored.read_component_into(0, target, cast=cast)

            first_component.unmatched = [  # type: ignore[attr-defined]
                f"{path}/{component_name(i)}" for i in range(1, n)
            ]
            return first_component
        if skind == "independent" and n > 1 and n != m:
            raise DeviceCountError(
                "independent buffers restore only onto the same number of devices",
                file=file,
                variable=path,
                expected=f"{m} devices",
                found=f"{n} devices in the file",
            )
        if live == "independent" and m > 1 and n != m:
            raise DeviceCountError(
                "an independent-buffers variable needs one saved component per device",
                file=file,
                variable=path,
                expected=f"{m} components",
                found=f"{n} components",
            )
        if isinstance(obj, ShardedVariable):
            full = obj.__wrapped__
            return lambda: read_logical_into(stored, full, file=file, cast=cast)

        same_layout = n == m and skind == live and skind != "sharded"
        if live == "on_read" and skind == "on_read":
            same_layout = (
                same_layout and str(stored.attrs.get("aggregation")) == obj.aggregation.value
            )
        if live == "independent" and n == m:
            same_layout = skind != "sharded"

        if same_layout:

            def componentwise() -> None:
                for i, c in zip(indices, comps, strict=True):
                    stored.read_component_into(i, c, cast=cast)

            return componentwise

        # The total of an on-read SUM variable goes to global component 0 only.
        zero = live == "on_read" and obj.aggregation.value == "sum"
        targets = [c for i, c in zip(indices, comps, strict=True) if not (zero and i != 0)]
        zeros = [c for i, c in zip(indices, comps, strict=True) if zero and i != 0]

        def logical() -> None:
            if targets:
                read_logical_into(stored, targets[0], file=file, cast=cast)
                for c in targets[1:]:
                    np.copyto(c, targets[0])
            for c in zeros:
                c[...] = 0

        return logical


register_saveable(ParallelVariable, ParallelVariableSaveable())
