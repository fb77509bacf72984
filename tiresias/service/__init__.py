"""The live Tiresias service: master (driver + SQLite state + executor), HTTP API, executors,
the per-run supervisor of the local executor, and the report feeds from AutoPS and Infiniswap."""
