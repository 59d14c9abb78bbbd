"""What a restore matched: :class:`CheckpointLoadStatus`, returned by ``Checkpoint.restore``."""

from __future__ import annotations

from typing import Any

from parallelvars.checkpoint._gcfreeze import older_objects_frozen
from parallelvars.checkpoint.graph import build_object_graph
from parallelvars.checkpoint.matching import RestoreSession
from parallelvars.errors import RestoreMismatchError

__all__ = ["CheckpointLoadStatus"]

_NOT_TAKEN = "no live object took it (so far)"


class CheckpointLoadStatus:
    """What a restore matched; assertions for tests and careful callers."""

    def __init__(self, session: RestoreSession, root: Any) -> None:
        self._session = session
        self._root = root

    def _optional(self) -> set[int]:
        """Live bookkeeping a file without it does not count against: the checkpoint's own
        ``save_counter`` when the saved file has none (a file another library wrote, or one
        exported model-only). As TensorFlow's checkpoint does for a name-based restore, the
        counter is then optionally restored: it keeps its value and no assertion names it."""
        counter = getattr(self._root, "save_counter", None)
        if counter is None or "save_counter" in self._session.variable_nodes().values():
            return set()
        return {id(counter)}

    def _unmatched_live(self) -> list[str]:
        live_graph = getattr(self._root, "_live_graph", None)  # (a Checkpoint keeps its own)
        with older_objects_frozen():  # a graph of the live objects: a few per variable
            graph = build_object_graph(self._root) if live_graph is None else live_graph()
            matched = {id(o) for o in self._session.matched.values()}
            matched |= self._optional()
            return [path for _, obj, path in graph.variables() if id(obj) not in matched]

    @property
    def unrestored_paths(self) -> list[str]:
        """Saved values not restored so far, sorted: no live object matched them yet (a slot
        waiting for its optimizer to create it, a name another model does not have), and the
        components 1.. of an independent variable read into a plain one."""
        missing = [
            p for i, p in self._session.variable_nodes().items() if i not in self._session.restored
        ]
        return sorted(missing + self._session.unmatched_parts)

    @property
    def unrestored_reasons(self) -> dict[str, str]:
        """Each of :attr:`unrestored_paths` with why it was not restored: what the restore
        found it cannot map (a TF1 slot whose optimizer cannot be told, a Keras 3 optimizer
        variable saved by position), else that no live object took it so far."""
        reasons = self._session.reasons
        return {p: reasons.get(p, _NOT_TAKEN) for p in self.unrestored_paths}

    @property
    def unmatched_live_paths(self) -> list[str]:
        """Variables reachable from the root now that no saved value was matched with, sorted."""
        return sorted(self._unmatched_live())

    def assert_consumed(self) -> CheckpointLoadStatus:
        """Every saved value was restored and every live variable was matched."""
        missing = self.unrestored_paths
        if missing:
            reasons = self._session.reasons
            raise RestoreMismatchError(
                "saved values were not restored (no matching live object yet)",
                file=self._session.path,
                expected="every saved variable restored",
                found=", ".join(
                    f"{p} ({reasons[p]})" if p in reasons else p for p in sorted(missing)[:20]
                ),
            )
        self.assert_existing_objects_matched()
        return self

    def assert_existing_objects_matched(self) -> CheckpointLoadStatus:
        """Every variable reachable from the root now was matched with a saved value."""
        unmatched = self._unmatched_live()
        if unmatched:
            raise RestoreMismatchError(
                "live variables have no value in the checkpoint",
                file=self._session.path,
                expected="every live variable matched",
                found=", ".join(sorted(unmatched)[:20]),
            )
        return self

    def assert_nontrivial_match(self) -> CheckpointLoadStatus:
        if not self._session.restored:
            raise RestoreMismatchError("nothing was restored", file=self._session.path)
        return self

    def expect_partial(self) -> CheckpointLoadStatus:
        """Declare that a partial restore is intended (nothing is reported either way)."""
        return self

    @property
    def restored_paths(self) -> list[str]:
        nodes = self._session.variable_nodes()
        return sorted(nodes[i] for i in self._session.restored)
