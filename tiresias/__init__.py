"""Tiresias: a GPU cluster scheduler for distributed deep learning (thesis ch. III).

Pure policy objects (``tiresias.policies``) that a trace-driven simulator (``tiresias.sim``)
and, later, the live master drive through the same small interface.
"""
