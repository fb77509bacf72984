"""dlrt: the small core the three systems share.

Only what AutoPS, Infiniswap and Tiresias all need lives here, and nothing here knows
about any of them: versioned messages and their errors (``messages``), this machine's
identity (``hostid``), addresses and endpoints (``endpoints``), a thread waker
(``waker``), stopping child processes (``procs``), one owner per state directory
(``statelock``), a run's request to its launcher to run it again later (``requeue``), job
traces read into plain records
(``trace``: AutoPS's and Tiresias's simulators replay the same traces) and the command-line
helpers every CLI uses (``cli``), and the ``dlrt`` command (``main``). Each system keeps its
own protocol on top. Emulated hosts for tests and benchmarks live with the benchmarks
(``dlrt_bench.testbed``).
"""
