"""Tesserae's placement policies (GPU sharing and migration), pure functions over plain data.

- ``profiles``: the co-location throughput store (isolated and packed speeds by job type).
- ``matching``: packing by maximum-weight bipartite matching (Algorithm 4) and Gavel's greedy rule.
- ``migration``: GPU-level migration between consecutive round plans (Algorithms 2-3).
- ``rounds``: one round's plan (Algorithm 1): place by priority, pack, then migrate.

The driver (``tiresias.driver``) applies a round's plan to its node state; nothing here keeps
state between rounds except what the caller passes in.
"""
