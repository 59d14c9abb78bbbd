"""``convert``: copy a checkpoint from one format to another, streaming entry by entry."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from parallelvars.checkpoint._gcfreeze import freeze_made_so_far, older_objects_frozen
from parallelvars.checkpoint.entry import CountingEntry
from parallelvars.errors import InvalidArgumentError

from ._names import check_names
from ._registry import format_for_suffix, get_format, open_checkpoint, write_checkpoint
from ._reshard import reshard
from ._select import exported
from ._view import CheckpointView, DictView, Entry, checked_summary

__all__ = ["convert", "format_for_path"]


def format_for_path(path: str | os.PathLike[str]) -> str | None:
    """The format an output file name implies (the longest matching suffix wins, so
    ``model.weights.h5`` is ``keras`` and ``run.h5`` is ``hdf5``), or None."""
    return format_for_suffix(path)


class _Progress:
    def __init__(self, callback: Callable[[int, int], Any], total: int) -> None:
        self.callback = callback
        self.total = total
        self.done = 0

    def add(self, n: int) -> None:
        self.done = min(self.total, self.done + n)
        self.callback(self.done, self.total)


def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    from_format: str | None = None,
    to_format: str | None = None,
    components: str = "all",
    names: str | None = None,
    max_shard_size: int | str | None = None,
    progress: Callable[[int, int], Any] | None = None,
    devices: int | None = None,
    read_options: Mapping[str, Any] | None = None,
    like: str | os.PathLike[str] | None = None,
    only: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
    model_only: bool = False,
    root: str | None = None,
    on_left_out: Callable[[Mapping[str, str]], Any] | None = None,
    on_written: Callable[[Mapping[str, Entry]], Any] | None = None,
) -> str:
    """Convert the checkpoint ``src`` into ``dst``, streaming its tensors in bounded runs.

    Args:
        src: the source file or folder.
        dst: the output file (or folder, for a safetensors shard set).
        from_format: the source format (default: detected from magic bytes, then suffix).
        to_format: the output format (default: from ``dst``'s suffix).
        components: ``"all"`` keeps every component of parallel variables; ``"logical"``
            writes one single entry per variable, its logical value whatever its kind (what a
            restore onto one device gives: a mirrored variable's primary, an on-read
            variable's aggregate, a sharded variable's full value); ``"primary"`` is the older
            name of ``"logical"``. A variable with no single value (independent buffers, on-read
            with aggregation ``none``) is refused (InvalidEntryError).
        names: key style for formats with flat keys (``"slash"``, ``"dotted"``, ``"tf"``)
            and for a TensorFlow checkpoint (``"tf"``: object-based, ``"slash"``: each
            variable under its path, ``"tf1"``: the names ``tf.compat.v1.train.Saver`` and
            TF 1.x's optimizers use); default: the format's own.
        max_shard_size: split safetensors output into shards of at most this size.
        progress: called as ``progress(bytes_done, bytes_total)``: once with 0 when the total
            (the bytes of the entries to write) is known, then after each tensor is read.
        devices: reshard onto this many devices first (see :func:`reshard`).
        read_options: options for the source format's reader (``follow_state_outside=True``
            for a TensorFlow directory whose state file names a checkpoint elsewhere, ...).
        like: for a Keras ``.keras`` archive, the model's own archive: its configuration is
            kept and its weights replaced; weights that do not fit it are refused
            (InvalidEntryError). For safetensors into a Hugging Face folder, the model's own
            folder, whose ``config.json``, tokenizer and processor files are carried (from a
            Hugging Face source folder they are carried without it); see
            :mod:`parallelvars.formats.safetensors._hf`.
        only: glob patterns of the paths to keep (``"model/*"``; a pattern naming a path
            also keeps what lies under it: ``"model"``); default: every path.
        exclude: glob patterns of the paths to leave out.
        model_only: leave out optimizer state (slots, step counts, beta powers) and the
            checkpoint's bookkeeping (``save_counter``, a root ``step``): what a library that
            loads a model strictly expects (see :mod:`parallelvars.formats._select`).
        root: export the subtree at this path as the whole (``"model"``: ``model/dense/kernel``
            goes out as ``dense/kernel``, ``dense.kernel`` in the dotted style of a torch
            ``state_dict``); everything outside it is left out.
        on_left_out: called once with ``{path: reason}`` of every path the selection left out
            (nothing is called when it left out nothing).
        on_written: called once the output is written, with the view handed to the writer:
            its entries, and the source's ``object_graph`` and ``metadata`` (what a caller
            reports of the output, or of what it could not carry, without opening a file
            again).

    Returns:
        The path written (the index file of a shard set).

    Example:
        >>> convert("run.h5", "model.safetensors", components="logical")  # doctest: +SKIP
        'model.safetensors'
    """
    if components not in ("all", "logical", "primary"):  # before the source is opened
        exported({}, components=components)
    target = to_format or format_for_path(dst)
    if target is None:
        raise InvalidArgumentError(
            f"{os.fspath(dst)}: cannot tell the output format from the name; pass to_format="
        )
    spec = get_format(target)
    options: dict[str, Any] = {}
    if names is not None:
        if spec.name != "tf":  # before the source is opened; TensorFlow's writer has its own
            check_names(names)
        if "names" not in spec.options:
            raise InvalidArgumentError(
                f"format {target!r} has no key style; names= applies to formats "
                "with flat keys (safetensors, npz) and TensorFlow checkpoints"
            )
        options["names"] = names
    if max_shard_size is not None:
        if "max_shard_size" not in spec.options:
            raise InvalidArgumentError(
                f"format {target!r} is not sharded by size; max_shard_size= applies to safetensors"
            )
        options["max_shard_size"] = max_shard_size
    if like is not None:
        if "like" not in spec.options:
            raise InvalidArgumentError(
                f"format {target!r} takes no template; like= applies to Keras .keras archives, "
                "legacy Keras files and Hugging Face folders (safetensors)"
            )
        options["like"] = os.fspath(like)
    with older_objects_frozen():  # (see _gcfreeze: what a conversion keeps is not walked again)
        return _convert(
            src,
            dst,
            from_format,
            target,
            components,
            options,
            progress,
            devices,
            dict(read_options or {}),
            only,
            exclude,
            model_only,
            root,
            on_left_out,
            on_written,
        )


class _AskedFor(CheckpointView):
    """A source view's entries as a conversion writes them all (no selection, no reshard):
    each made by the view when a writer asks for it (and wrapped by ``wrap``), none kept here
    (``makes_entries``: a writer's plan may let them go between its runs too), so a
    conversion holds no entry per variable for its whole length; with the source's format,
    path, metadata, files and object graph; each entry's bytes are noted as it is first made
    (:meth:`entry_nbytes`)."""

    makes_entries = True

    def __init__(
        self,
        view: CheckpointView,
        wrap: Callable[[Entry], Entry] | None = None,
        hold_graph: bool = False,
    ):
        self._view, self._wrap = view, wrap
        # (held only where it is read after the source is closed: the command line reports a
        # TensorFlow output's graph then; any other writer lets it go once it is written)
        self._graph = getattr(view, "object_graph", None) if hold_graph else None
        self._nbytes: dict[str, int] = {}
        self.format, self.path, self.metadata = view.format, view.path, dict(view.metadata or {})
        self.files = view.files
        if wrap is None:  # (a wrapped entry is its wrapper's, not the summary's)
            self.summaries_match_entries = bool(getattr(view, "summaries_match_entries", False))
        bulk = getattr(view, "bulk_components", None)
        if bulk is not None and wrap is None:  # (a wrapped entry's reads are its wrapper's)
            # Each of a list of paths with its components read in bulk, checksums checked, or
            # None (read that one as ``self[path]``): what a writer's plan reads a run's
            # variables with when it does not hold their entries (_plan.read_batches).
            self.bulk_components = bulk

    @property
    def object_graph(self) -> Any:
        """The source view's object graph, asked for when read (held here only with
        ``hold_graph``: a writer lets it go once it is written, 77 MB of objects at 50,000
        variables with Adam's slots)."""
        if self._graph is not None:
            return self._graph
        return getattr(self._view, "object_graph", None)

    def __getitem__(self, key: str) -> Entry:
        entry = self._view[key]
        if key not in self._nbytes:
            self._nbytes[key] = int(entry.nbytes)
        return entry if self._wrap is None else self._wrap(entry)

    def summary(self, key: str) -> tuple[str, Any, tuple[int, ...], int, int, Any] | None:
        """The source view's summary of ``key`` (its layout, bytes and attributes, no entry
        made; None where it has none): what the HDF5 writer plans from."""
        get = getattr(self._view, "summary", None)
        known = None if get is None else get(key)
        if known is not None:
            known = checked_summary(known, getattr(self._view, "path", None), key)
            self._nbytes.setdefault(key, int(known[4]))
        return known

    def entry_nbytes(self, key: str) -> int:
        """``self[key].nbytes``, noted when the entry was first made (a number per variable:
        what a caller reports of the output, without making every entry again)."""
        known = self._nbytes.get(key)
        return known if known is not None else int(self[key].nbytes)

    def __iter__(self) -> Iterator[str]:
        return iter(self._view)

    def __len__(self) -> int:
        return len(self._view)


def _convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    from_format: str | None,
    target: str,
    components: str,
    options: dict[str, Any],
    progress: Callable[[int, int], Any] | None,
    devices: int | None,
    read_options: dict[str, Any],
    only: Sequence[str] | None,
    exclude: Sequence[str] | None,
    model_only: bool,
    root: str | None,
    on_left_out: Callable[[Mapping[str, str]], Any] | None,
    on_written: Callable[[Mapping[str, Entry]], Any] | None,
) -> str:
    view = open_checkpoint(src, format=from_format, **read_options)
    freeze_made_so_far()  # (the view's index and documents live until the end)
    try:
        # (The source's object graph is held where it is read more than once: a selection or
        # a logical export reads it to choose and again to derive its view, and the command
        # line reports a TensorFlow output's graph after the source is closed; a whole
        # conversion's writer reads it once and lets it go.)
        hold = target == "tf" or bool(only or exclude or model_only or root) or components != "all"
        selected: CheckpointView
        if devices is None:
            selected = _AskedFor(view, hold_graph=hold)
        else:
            selected = DictView.derived(view, dict(reshard(view, devices).items()))
        chosen = exported(
            selected,
            components=components,
            only=only,
            exclude=exclude,
            model_only=model_only,
            root=root,
            on_left_out=on_left_out,
            file=os.fspath(src),
            target=target,
        )
        entries: Mapping[str, Entry] = chosen if chosen is selected else dict(chosen.items())
        freeze_made_so_far()  # (the entries, too)
        if progress is not None:
            total = sum(int(e.nbytes) for e in entries.values())
            counter = _Progress(progress, total)
            if isinstance(entries, _AskedFor):
                entries = _AskedFor(view, lambda e: CountingEntry(e, counter.add), hold_graph=hold)
            else:
                entries = {k: CountingEntry(e, counter.add) for k, e in entries.items()}
            progress(0, total)  # the total, before the first tensor is read
        written = entries if isinstance(entries, _AskedFor) else DictView.derived(selected, entries)
        result = write_checkpoint(os.fspath(dst), written, format=target, **options)
        if progress is not None and counter.done < counter.total:
            progress(counter.total, counter.total)  # writers may skip reads (empty tensors)
        if on_written is not None:
            on_written(written)
        return result
    finally:
        view.close()
