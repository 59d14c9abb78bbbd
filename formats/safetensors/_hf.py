"""The small files of a Hugging Face model folder that travel with its weights.

A model folder holds, beside ``model.safetensors`` (or a shard set), the files its library
reads to build the model and its tokenizer: ``transformers``' ``from_pretrained`` needs
``config.json`` and reads ``generation_config.json``; ``AutoTokenizer`` and
``AutoProcessor`` read the tokenizer and processor files. A safetensors write whose output is
a Hugging Face folder (written under Hugging Face's names: ``model.safetensors`` or a shard set's
``model.safetensors.index.json``) carries them from the folder its source came from (a view of
a Hugging Face folder), or from the folder ``like=`` names (the model's own folder, for a
checkpoint trained from it):

* only the names of :data:`HF_FILES`: never weights, other files or sub-folders;
* each one found is hostile: a regular file (:func:`~parallelvars._fileio.open_input`'s rule: a
  symbolic link only into the folder itself, or into a Hugging Face cache's ``blobs/``), at most
  :data:`MAX_HF_FILE_BYTES`, read whole before any weight is written, so that a refusal leaves
  the destination as it was;
* copied byte for byte, never parsed, each file written atomically; a file of that name
  already in the destination is kept as it is (it may be the user's own).
"""

from __future__ import annotations

import os

from parallelvars._fileio import atomic_path, read_input
from parallelvars.errors import InvalidArgumentError

__all__ = ["HF_FILES", "MAX_HF_FILE_BYTES", "HfFiles", "hf_files_for", "is_hf_output"]

#: The files carried, by name: the model's configuration, then the tokenizer's and processor's.
HF_FILES: tuple[str, ...] = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "preprocessor_config.json",
    "processor_config.json",
    "chat_template.jinja",
    "chat_template.json",
)

#: The largest file carried (tokenizer.json of a large vocabulary: tens of MB).
MAX_HF_FILE_BYTES = 64 << 20

_HF_OUTPUTS = ("model.safetensors", "model.safetensors.index.json")


def is_hf_output(path: str) -> bool:
    """Whether a safetensors write at ``path`` (the file or index written) makes a Hugging Face
    folder: its name is one Hugging Face gives a model's weights."""
    return os.path.basename(path) in _HF_OUTPUTS


class HfFiles:
    """The files of :data:`HF_FILES` read from ``folder``, to be written beside the weights.

    Attributes:
        folder: the Hugging Face folder read.
        contents: name -> bytes, for each file found there.
    """

    def __init__(self, folder: str, contents: dict[str, bytes]) -> None:
        self.folder = folder
        self.contents = contents

    def write(self, destination: str) -> list[str]:
        """Write each file into the folder ``destination``, keeping a file already there;
        returns the names written."""
        written = []
        for name, data in self.contents.items():
            target = os.path.join(destination, name)
            if os.path.lexists(target):
                continue
            with atomic_path(target) as tmp, open(tmp, "wb") as f:
                f.write(data)
            written.append(name)
        return written


def _read(folder: str, referrer: str) -> HfFiles:
    contents = {}
    for name in HF_FILES:
        path = os.path.join(folder, name)
        if not os.path.lexists(path):
            continue
        contents[name] = read_input(
            path,
            max_bytes=MAX_HF_FILE_BYTES,
            what=f"Hugging Face {name}",
            within=folder,
            referrer=referrer,
        )
    return HfFiles(folder, contents)


def hf_files_for(source: object, like: str | os.PathLike[str] | None) -> HfFiles | None:
    """The files to carry: from ``like`` (a Hugging Face model folder, or a file in one) when
    given, else from the folder of ``source`` (a view) when it is a safetensors view of a
    folder holding ``config.json``; None when there is nothing to carry.

    Raises:
        InvalidArgumentError: ``like`` is not a folder holding ``config.json``.
        CorruptCheckpointError: a file found there breaks the rule above (not a regular file,
            a link out of the folder, too large), naming it.
    """
    if like is not None:
        given = os.fspath(like)
        folder = given if os.path.isdir(given) else os.path.dirname(given) or os.curdir
        if not os.path.isfile(os.path.join(folder, "config.json")):
            raise InvalidArgumentError(
                f"{given}: like= for safetensors names a Hugging Face model folder, which holds "
                "config.json; none is there"
            )
        return _read(folder, given)
    if getattr(source, "format", None) != "safetensors":
        return None
    path = getattr(source, "path", None)
    if not isinstance(path, str) or not path or path.startswith("<"):
        return None
    folder = path if os.path.isdir(path) else os.path.dirname(path) or os.curdir
    if not os.path.lexists(os.path.join(folder, "config.json")):
        return None
    return _read(folder, path)
