"""The byte-level HDF5 layer: what we read and write of HDF5 without libhdf5.

One module per concept: :mod:`.lookup3` (HDF5's metadata checksum, scalar and vectorised),
:mod:`.source` (bounded reads, :class:`~.source.Refused`), :mod:`.header` (the object header
parser and encoder), :mod:`.messages` (header message bodies), :mod:`.global_heap`
(collections: built, and checked before HDF5 reads them).
"""
