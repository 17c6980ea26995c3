"""The data wing: what a fit reads (arrays, Parquet streams, iterables of batches), their noise models, how
they are cut into batches, and the validation of the data a fit is given."""
