"""A made-up survey, defined here only (``test_surveys.py``): a CSV of three measured features with their
errors and one published correlation, turned into a features file as the guide says a survey is. Its
colour and magnitude play those roles; nothing plays sky position or parallax."""

import numpy as np
import pandas as pd

from scalable_xd.pipeline.features_file import Features, FeatureSpec, write_splits

SPEC = FeatureSpec(
    "toy_survey",
    ("colour", "magnitude", "distance"),
    ("mag", "mag", "pc"),
    (("c_d_corr", 0, 2),),
    roles=(("colour", "colour"), ("magnitude", "magnitude")),
    labels=("g - r [mag]", "r [mag]", "distance [pc]"),
)


def write_feature_splits(raw, out_dir, *, mode: str, split_seed: int) -> dict:
    frame = pd.read_csv(raw)
    features = Features(
        SPEC,
        X=frame[["colour", "magnitude", "distance"]].to_numpy(),
        sigma=frame[["colour_error", "magnitude_error", "distance_error"]].to_numpy(),
        corr=frame[["c_d_corr"]].to_numpy(),
        n_missing=np.zeros(len(frame), np.int8),
        source_id=frame["id"].to_numpy(),
        random_index=frame["id"].to_numpy(),
        mode=mode,
    )
    rows, _ = write_splits(iter([features]), out_dir, SPEC, mode, split_seed, has_truth=False)
    return {"rows": rows}
