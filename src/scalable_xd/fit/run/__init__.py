"""What a running fit's epoch loop (``fit.loop``) and its engines share: the loop's settings
(``loop_config``), scoring, checkpoints, fits in lockstep and the processes of a data-parallel fit
(``parallel``)."""
