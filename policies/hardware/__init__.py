"""Hardware: what the fleet is.

- :mod:`policies.hardware.catalog` - datasheet figures of every GPU generation mixfleet knows;
- :mod:`policies.hardware.fleet` - :class:`~policies.hardware.fleet.Fleet`: nodes, their GPUs,
  NVLink domains and network interfaces;
- :mod:`policies.hardware.inventory` - what a node agent reports (GPUs, links, NICs, health);
- :mod:`policies.hardware.topology` - the fleet as a networkx graph;
- :mod:`policies.hardware.vendors` - keeping expert-parallel groups inside one GPU vendor.

Pure: no I/O.
"""
