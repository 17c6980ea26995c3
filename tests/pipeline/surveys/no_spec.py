"""A survey module without its ``SPEC`` (``test_surveys.py``): refused, naming what it lacks."""


def write_feature_splits(raw, out_dir, *, mode: str, split_seed: int) -> dict:
    raise AssertionError("never called: the module is refused first")
