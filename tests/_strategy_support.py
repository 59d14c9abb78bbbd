"""Shared by the strategy tests: run a strategy step with a deadline, so a bug fails fast."""

from __future__ import annotations

import contextvars
import threading
from typing import Any

DEADLINE_S = 10.0


def run_with_deadline(strategy: Any, fn: Any, args: Any = (), kwargs: Any = None) -> Any:
    """``strategy.run`` from a helper thread carrying this thread's context, with a deadline."""
    box: dict[str, Any] = {}
    ctx = contextvars.copy_context()

    def target() -> None:
        try:
            box["result"] = ctx.run(strategy.run, fn, args, kwargs)
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(DEADLINE_S)
    assert not t.is_alive(), f"strategy.run did not return within {DEADLINE_S} s"
    if "error" in box:
        raise box["error"]
    return box["result"]
