"""AutoPS: a parameter service that many training jobs share (thesis ch. IV).

One package per process: ``worker`` (the agent inside each training worker), ``aggregator``
(``autops aggregator``, one per machine that lends CPU) and ``master`` (pMaster, ``autops
master``); below them, shared by all three, ``wire`` (what they agree on: protocol, keys,
authentication, optimizers, cycles) and ``transport`` (how bytes move). Above them: ``torch``
(the Horovod/BytePS-shaped API for PyTorch scripts), ``config`` (the processes' settings),
``local`` (an embedded pool on one machine), ``admin`` (the operator's client of pMaster),
``models`` (model tensor shapes) and ``cli`` (the ``autops`` command).
"""
__version__ = "0.1.0"
