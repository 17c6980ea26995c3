"""Fitting: the update rules (``updates``), the three methods as state machines over kernel statistics
(``fitters``), the epoch loop (``loop``), k-means initialisation (``kmeans``) and checkpoints
(``checkpoint``)."""
