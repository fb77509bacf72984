"""dlrt_bench: the runtime's benchmarks and the test-bed pieces they share.

Installed with the distribution, so ``autops bench NAME`` and ``infiniswap bench`` work from
a fresh install; those subcommands (and ``dlrt testbed``) import this package only when they
run (the libraries never import it otherwise). Every module imports the libraries, never the
other way round:

* ``autops_pushpull`` -- push+pull of whole models vs gloo all-reduce, on this machine or on
  emulated hosts (its worker processes in ``pushpull_workers``, where they run in
  ``pushpull_sites``; an AutoPS pool on emulated hosts in ``autops_hosts``);
* ``autops_packing`` / ``autops_migrate`` -- AutoPS elasticity (shared pieces in
  ``autops_elastic``);
* ``infiniswap_bench`` -- remote memory (shm, TCP) vs the backup file;
* ``infiniswap_stack`` -- daemons + device + FUSE/loop/swap on this machine, a disk swap to
  compare with, and a watchdog (the e2e tests, ``bench/`` scripts and the demo use them);
* ``workload`` -- a self-checking memory-intensive application (``python -m dlrt_bench.workload``);
* ``testbed`` -- emulated hosts: network namespaces on one bridge, shaped links (the benchmarks'
  ``--emulate-hosts``, the multi-host tests); ``testbed_cli`` -- the ``dlrt testbed`` commands,
  which ``dlrt.main`` imports only when that command runs.

The ``bench/*.py`` scripts are thin entry points to these and to the Tiresias benchmarks.
"""
