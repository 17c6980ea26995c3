"""The subcommands of ``scalable-xd``, by the part of the experiment they run: ``data`` (the catalogue, the
bulk files, the features), ``fitting`` (k-means, the fits, the references, a table of one's own) and
``report`` (tables, denoising, figures); ``options``: how a subcommand and its options are declared."""
