"""Parallel devices: an ordered tuple of component device names."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from parallelvars._values import ParallelValue, PerReplica
from parallelvars.errors import DistributedValueError

__all__ = ["ParallelDevice", "canonical_device"]

# What ``pack(values, name=...)`` calls to make a variable: (name, values, device, kind) -> the
# variable. Variables sit above devices (a variable holds its ParallelDevice), so the layer that
# sees both hands the constructor down: parallelvars/__init__.py sets it when the package is
# imported, before any module of the package can be.
VariableConstructor = Callable[[str, Sequence[Any], "ParallelDevice", str], Any]
_make_variable: VariableConstructor | None = None


def set_variable_constructor(make: VariableConstructor) -> None:
    """Hand ``ParallelDevice.pack(name=...)`` the function that makes a variable (done once,
    by the package's ``__init__``)."""
    global _make_variable
    _make_variable = make


def canonical_device(name: str) -> str:
    """Normalise a device name: ``"CPU:0"``, ``"/device:CPU:0"`` and ``"cpu:0"`` are the same."""
    text = str(name).strip()
    for prefix in ("/device:", "device:", "/"):
        if text.lower().startswith(prefix):
            text = text[len(prefix) :]
    kind, sep, index = text.rpartition(":")
    if not sep or not kind or not index.isdigit():
        raise DistributedValueError(
            f"invalid device name {name!r} (expected 'kind:index', e.g. 'cpu:0')"
        )
    return f"{kind.lower()}:{int(index)}"


class ParallelDevice(Sequence[str]):
    """An ordered set of component devices; component ``i`` of a variable lives on ``components[i]``.

    Example:
        >>> ParallelDevice(2).components
        ('cpu:0', 'cpu:1')
        >>> len(ParallelDevice(["cpu:0", "gpu:1"]))
        2
    """

    __slots__ = ("_components",)

    def __init__(self, devices: int | Iterable[str] | ParallelDevice) -> None:
        if isinstance(devices, ParallelDevice):
            names: tuple[str, ...] = devices.components
        elif isinstance(devices, int) and not isinstance(devices, bool):
            if devices < 1:
                raise DistributedValueError(
                    f"a parallel device needs at least one component, got {devices}"
                )
            names = tuple(f"cpu:{i}" for i in range(devices))
        elif isinstance(devices, str):
            names = (canonical_device(devices),)
        else:
            names = tuple(canonical_device(d) for d in devices)  # type: ignore[union-attr]
            if not names:
                raise DistributedValueError("a parallel device needs at least one component device")
        if len(set(names)) != len(names):
            raise DistributedValueError(f"component devices must be distinct, got {list(names)}")
        self._components = names

    @property
    def components(self) -> tuple[str, ...]:
        """The component device names, in order."""
        return self._components

    @property
    def name(self) -> str:
        """A readable name for the whole parallel device."""
        return "parallel(" + ",".join(self._components) + ")"

    def pack(self, values: Sequence[Any], *, name: str | None = None) -> Any:
        """One per-device value from ``values[i]`` on ``components[i]`` (the parallel-device
        ``pack``).

        Args:
            values: one value per component device, in order.
            name: when given, the values become the components of a new independent-buffers
                variable of that name on this device (each component keeps its own value);
                otherwise the result is a :class:`~parallelvars.strategy.ParallelValue` (a
                :class:`~parallelvars.PerReplica` on which every operation applies to each
                element, as on the seed's parallel tensor), which ``strategy.run`` hands out
                one value per replica.

        Raises:
            DistributedValueError: not one value per component device.
        """
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise DistributedValueError(
                f"pack() takes one value per device of {self!r} (a list or tuple), found "
                f"{type(values).__name__}"
            )
        self._check_count("pack", len(values))
        if name is None:
            return ParallelValue(list(values))
        if _make_variable is None:  # only while parallelvars/__init__.py itself runs
            raise DistributedValueError(
                f"pack(name={name!r}) on {self!r} before the parallelvars package was imported"
            )
        kind = "independent" if len(self._components) > 1 else "single"
        return _make_variable(name, values, self, kind)

    @property
    def device_ids(self) -> Any:
        """Each component device's index, as a parallel value: ``unpack`` gives ``[0, 1, ...]``
        (the parallel device's ``device_ids``)."""
        import numpy as np

        return ParallelValue([np.int64(i) for i in range(len(self._components))])

    def unpack(self, value: Any) -> list[Any]:
        """The per-device parts of ``value``, one per component device (the parallel-device
        ``unpack``): a :class:`~parallelvars.PerReplica`'s values, or a variable's components
        (numpy views of its buffers) when the variable lives on this device.

        Raises:
            DistributedValueError: ``value`` is not per-device, or is placed on other devices.
        """
        if isinstance(value, PerReplica):
            parts = list(value.values)
        elif hasattr(value, "_self_components") and hasattr(value, "devices"):
            if tuple(value.devices) != self._components:
                raise DistributedValueError(
                    f"unpack() of variable {value.name!r}: it lives on {list(value.devices)}, "
                    f"not on {list(self._components)}"
                )
            parts = list(value.components)
        else:
            raise DistributedValueError(
                f"unpack() onto {self!r} takes a per-device value (PerReplica or a variable), "
                f"found {type(value).__name__}"
            )
        self._check_count("unpack", len(parts))
        return parts

    def _check_count(self, method: str, found: int) -> None:
        if found != len(self._components):
            raise DistributedValueError(
                f"{method}() onto {self!r}: expected {len(self._components)} values, found {found}"
            )

    def __len__(self) -> int:
        return len(self._components)

    def __getitem__(self, i):
        return self._components[i]

    def __iter__(self) -> Iterator[str]:
        return iter(self._components)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ParallelDevice):
            return self._components == other._components
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._components)

    def __repr__(self) -> str:
        return f"ParallelDevice({list(self._components)!r})"
