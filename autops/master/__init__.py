"""pMaster (``autops master``): the pool state, the assignment of keys to aggregators,
elastic packing and scaling, migration and failover planning, the providers that start
aggregators, its records on disk, and its utilization reports; also ``autops simulate``,
which runs the same policies over a trace. Imports ``wire`` and ``transport`` only, never
the worker's or the aggregator's packages."""
