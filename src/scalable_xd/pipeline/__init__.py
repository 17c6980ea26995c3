"""The experiment pipeline that reproduces Ritchie & Murray (2019) on top of the library: the command line
(``cli``) over one function per workflow step (``steps``), the survey sources (``gaia``: the archive
query, the mock, ESA's bulk files and the features file), the truth metrics of a mock (``truth``), the
report (``report``: metrics records, tables, figures, claims) and one GPU per concurrent job
(``gpu_slots``). Nothing in the library imports it."""
