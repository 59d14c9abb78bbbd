"""The byte-level HDF5 layer: what we read and write of HDF5 without libhdf5.

One module per concept:

* :mod:`.lookup3`: HDF5's metadata checksum, scalar and vectorised over many blocks;
* :mod:`.source`: bounded reads from a file or an image, and :class:`~.source.Refused`;
* :mod:`.header`: object headers (versions 1 and 2, continuation chunks): the one bounded
  parser, and the encoder;
* :mod:`.messages`: the header message bodies we write (datatypes, dataspaces, attributes,
  links, layouts...), and the attribute decoder;
* :mod:`.global_heap`: global heap collections, built for a generated file and checked before
  HDF5 reads a variable-length value (:class:`~.global_heap.GlobalHeapCheck`);
* :mod:`.fractal_heap`: where a fractal heap direct block lies (dense link storage);
* :mod:`.symbol_table`: symbol tables (local heap, v1 B-tree, symbol table nodes): how a
  generated group of more than 1,024 links keeps them, and their bounded reader;
* :mod:`.links`: which names are reached from the root by hard links only, by a bounded walk
  of the groups on their way (the commands' check before reading components in bulk);
* :mod:`.virtual`: a virtual dataset's mapping;
* :mod:`.templates`: object headers of one layout made from a template, many at once;
* :mod:`.objects`: a generated file's groups, datasets and attributes before they are laid
  out, and the layouts variable groups share;
* :mod:`.generate`: a native file's metadata generated from its structure
  (:class:`~.generate.FilePlan`);
* :mod:`.native`: whole native files written through the generator, and the plans a
  repeated save reuses;
* :mod:`.index_file`: a multi-process checkpoint's index file written through the generator.
"""
