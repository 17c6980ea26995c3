"""Tables and figures of the paper, from the metrics and models the fit steps write."""
