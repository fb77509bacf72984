"""The aggregator process (``autops aggregator``): the keyed tensor store and the data path
that serves pushes and pulls, server-side optimizers, and the aggregator's side of live
migration, replication, recovery, memory reserve and cyclic execution. Imports ``wire`` and
``transport`` only, never the worker's or pMaster's packages."""
