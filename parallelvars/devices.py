"""Parallel devices: an ordered tuple of component device names."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from parallelvars.errors import DistributedValueError

__all__ = ["ParallelDevice", "canonical_device"]


def canonical_device(name: str) -> str:
    """Normalise a device name: ``"CPU:0"``, ``"/device:CPU:0"`` and ``"cpu:0"`` are the same."""
    text = str(name).strip()
    for prefix in ("/device:", "device:", "/"):
        if text.lower().startswith(prefix):
            text = text[len(prefix):]
    kind, sep, index = text.rpartition(":")
    if not sep or not kind or not index.isdigit():
        raise DistributedValueError(f"invalid device name {name!r} (expected 'kind:index', e.g. 'cpu:0')")
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
                raise DistributedValueError(f"a parallel device needs at least one component, got {devices}")
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
