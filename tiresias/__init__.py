"""Tiresias: a GPU cluster scheduler for distributed deep learning (thesis ch. III).

Pure policy objects (``tiresias.policies``) driven through one driver (``tiresias.driver``) by
a trace-driven simulator (``tiresias.sim``) and by the live master (``tiresias.service``);
``tiresias.job`` is what a training job imports to be preemptible.
"""
