"""Fitting: the table of methods (``methods``), one fit from start to finish (``driver``), the update rules
(``updates``), the methods as state machines over kernel statistics (``fitters``), the epoch loop
(``loop``), initialisation (``init``, ``kmeans``), checkpoints (``checkpoint``), split-and-merge moves
(``split_merge``) and data-parallel processes (``parallel``)."""
