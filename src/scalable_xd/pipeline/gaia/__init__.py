"""The Gaia DR2 data path: archive query, DR2-like mock catalogue, features and noise covariances."""
