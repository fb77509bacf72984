"""Optimus (EuroSys'18) as pure models and allocators: no processes, no clock, no driver.

- ``convergence``: the online loss-curve fit of §3.1 (how many steps a job still needs).
- ``speed``: the resource-to-speed models of §3.2 (steps per second at ``p`` aggregators, ``w`` workers).
- ``allocation``: the marginal-gain allocator of §4.1 (eq. (9)).
- ``placement``: the smallest-job-first, fewest-nodes, even-spread placement of §4.2 (Theorem 1).
- ``baselines``: the DRF and Tetris allocators the paper compares with (§6.1).

Nothing here imports the driver, the simulator or the live service; they import this.
"""
