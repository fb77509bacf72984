"""AutoPS: a parameter service that many training jobs share (thesis ch. IV).

Components: ``master`` (pMaster), ``aggregator`` (one per machine), ``agent`` (inside
each worker) and ``torch`` (the Horovod/BytePS-shaped API for PyTorch scripts).
"""
__version__ = "0.1.0"
