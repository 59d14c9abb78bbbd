"""What our Keras files add to Keras' layout: the reserved group of extra components, the
root and dataset attributes of the parallel info and the checksums, the metadata keys.
"""

from __future__ import annotations

import re

RESERVED = "_parallel_components"
INFO_ATTR = "parallelvars"
#: Dataset attribute: CRC-32C of the dataset's bytes (Keras ignores attributes it does not know).
CRC_ATTR = "crc32c"
#: Root attribute: CRC-32C of a canonical description of everything the reader takes from the
#: file besides tensor bytes (dataset keys, order, dtypes, shapes and CRCs, layer and weight
#: names, the groups' attributes, the parallel info).
STRUCTURE_ATTR = "parallelvars_crc32c"
_OWN_ROOT_ATTRS = (INFO_ATTR, STRUCTURE_ATTR)
KERAS_LAYOUT = "keras_weights_layout"
LEGACY_LAYOUT = "keras_legacy_layout"

# A legacy weight name's ":<n>" suffix (``kernel:0``), which its dataset path does not carry.
_SUFFIX_RE = re.compile(r":\d+$")
