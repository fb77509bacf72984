"""What runs inside a training worker: the agent (mapping table, asynchronous push and pull,
iteration counters; its I/O thread in ``ioloop``) and the pieces ``autops.torch`` builds on
(the process's connection, CUDA staging, the distributed optimizer, push coalescing). Imports
``wire`` and ``transport`` only, never the aggregator's or pMaster's packages."""
