"""Fitting: the table of methods (``methods``), one fit from start to finish (``driver``), the update rules
(``rules``: each in torch, its compiled forms beside it), the methods as state machines over kernel
statistics (``fitters``: the protocol; ``batch_em``, ``online_em``, ``sgd``, ``averaging``: the families),
how batches run on a device (``engines``), the epoch loop (``loop``), scoring (``scoring``), initialisation
(``init``, ``kmeans``), checkpoints (``checkpoint``), split-and-merge moves (``split_merge``) and
data-parallel processes (``parallel``)."""
