"""What AutoPS's processes agree on, below all of them: the protocol (``protocol``), how a
job's tensors become keys (``partition``), the cluster's and jobs' authentication
(``clusterauth``, ``jobauth``), the server optimizers' names and hyper-parameters
(``optimizers``), and the arithmetic of cyclic execution (``cycles``)."""
