"""The collector's permanent generation during a long save or restore (checkpoint/_gcfreeze.py):
the objects that existed before are frozen and given back; a save freezes what it made so far
too; a program's own freeze is never touched."""

from __future__ import annotations

import gc

from parallelvars.testing import gcfreeze

freeze_made_so_far = gcfreeze.freeze_made_so_far
older_objects_frozen = gcfreeze.older_objects_frozen


def test_what_a_save_made_so_far_is_frozen_inside_and_given_back_after() -> None:
    assert gc.get_freeze_count() == 0
    with older_objects_frozen():
        before = gc.get_freeze_count()
        made = [[k] for k in range(1000)]  # (containers the collector tracks)
        assert gc.is_tracked(made)
        freeze_made_so_far()
        assert gc.get_freeze_count() >= before + len(made)
    assert gc.get_freeze_count() == 0
    del made


def test_outside_a_frozen_block_nothing_is_frozen() -> None:
    freeze_made_so_far()
    assert gc.get_freeze_count() == 0


def test_a_programs_own_freeze_is_left_alone() -> None:
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with older_objects_frozen():
            _ = [[k] for k in range(100)]
            freeze_made_so_far()
            assert gc.get_freeze_count() == frozen
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
