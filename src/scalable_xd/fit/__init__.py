"""Fitting: the table of methods (``methods``), a fit's plan (``plan``), one fit from start to finish
(``driver``), its epochs (``loop``), restarts and ``partial_fit``; the Fitter protocol (``fitters``) and the
methods as state machines over kernel statistics (``families``: batch EM, online EM, SGD and what is built
on them); the update rules (``rules``: each in torch, its compiled forms beside it); how batches run on a
device (``engines``); what the loop and the engines share (``run``: scoring, checkpoints, lockstep,
data-parallel processes); where a fit starts (``starts``: the starting mixture, k-means)."""
