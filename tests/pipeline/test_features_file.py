"""The features file is survey-neutral: another survey is a spec and its own Features chunks."""

import numpy as np
import pytest
import torch

from scalable_xd import XDGMM
from scalable_xd.pipeline.features_file import (
    Features,
    FeatureSpec,
    features_source,
    read_features,
    split_facts,
    write_splits,
)
from scalable_xd.pipeline.gaia.schema import GAIA_DR2

# A made-up survey: three features, one published correlation (between the first and the third).
TOY = FeatureSpec("toy_survey", ("colour", "magnitude", "distance"), ("mag", "mag", "pc"), (("c_d_corr", 0, 2),))


def _chunk(rng, start, n):
    return Features(
        TOY,
        X=rng.normal(size=(n, 3)) * [1, 2, 30],
        sigma=rng.uniform(0.1, 0.5, size=(n, 3)),
        corr=rng.uniform(-0.5, 0.5, size=(n, 1)),
        n_missing=np.zeros(n, np.int8),
        source_id=np.arange(start, start + n),
        random_index=np.arange(start, start + n),
        mode="toy",
    )


def test_another_surveys_features_go_through_the_same_file(tmp_path):
    rng = np.random.default_rng(0)
    chunks = [_chunk(rng, 0, 700), _chunk(rng, 700, 500)]
    rows, missing = write_splits(iter(chunks), tmp_path, TOY, "toy", split_seed=3, has_truth=False)
    assert sum(rows.values()) == 1200 and sum(missing.values()) == 0
    parts = {name: read_features(tmp_path / f"{name}.parquet") for name in rows}
    assert {name: len(part) for name, part in parts.items()} == rows
    assert all(part.spec == TOY and part.mode == "toy" for part in parts.values())
    # every star once, its values unchanged (the correlations are stored in float32)
    ids = np.concatenate([part.source_id for part in parts.values()])
    order = np.argsort(ids)
    stacked = (np.concatenate([getattr(p, a) for p in parts.values()])[order] for a in ("X", "sigma", "corr"))
    both = Features(TOY, *stacked, n_missing=None, source_id=None, random_index=None, mode="toy")
    original = np.concatenate([c.X for c in chunks])
    np.testing.assert_array_equal(both.X, original)
    np.testing.assert_allclose(both.corr, np.concatenate([c.corr for c in chunks]), rtol=1e-7)

    # the noise matrices, built by hand: sigma_i sigma_j rho on the published pair, zero elsewhere
    cov = both.covariance().batch(np.arange(5), "cpu", torch.float64).numpy()
    s, rho = both.sigma[:5], both.corr[:5, 0]
    expected = np.zeros((5, 3, 3))
    expected[:, [0, 1, 2], [0, 1, 2]] = s**2
    expected[:, 0, 2] = expected[:, 2, 0] = s[:, 0] * s[:, 2] * rho
    np.testing.assert_allclose(cov, expected, rtol=1e-12)

    facts = split_facts(tmp_path / "train.parquet")
    assert facts["n"] == rows["train"] and facts["mode"] == "toy" and not facts["true_values"]
    model = XDGMM(2, "em", epochs=3, dtype="float64", device="cpu", random_state=0)
    model.fit(features_source(tmp_path / "train.parquet"))
    assert model.means_.shape == (2, 3) and np.isfinite(model.history_[-1]["train_loglik"])


def test_gaia_dr2_is_one_spec():
    assert GAIA_DR2.names == ("ra", "dec", "parallax", "pmra", "pmdec", "bp_rp", "phot_g_mean_mag")
    assert len(GAIA_DR2.correlations) == 10 and GAIA_DR2.pairs[0] == (0, 1)
    assert FeatureSpec.from_dict(GAIA_DR2.as_dict()) == GAIA_DR2


@pytest.mark.parametrize(
    "units, correlations, message",
    [
        (("mag",), (), "3 feature names but 1 units"),
        (("mag", "mag", "pc"), (("bad", 2, 0),), "correlation bad couples features 2 and 0"),
    ],
)
def test_a_spec_that_does_not_add_up_is_refused(units, correlations, message):
    with pytest.raises(ValueError, match=message):
        FeatureSpec("toy_survey", ("colour", "magnitude", "distance"), units, correlations)


@pytest.mark.parametrize(
    "roles, labels, message",
    [
        ((("shape", "colour"),), (), "unknown role 'shape'"),
        ((("parallax", "distance_pc"),), (), "role parallax names 'distance_pc', not one of its features"),
        ((("colour", "colour"), ("colour", "magnitude")), (), "a role is given twice"),
        ((), ("g - r",), "3 feature names but 1 labels"),
    ],
)
def test_roles_and_labels_that_do_not_add_up_are_refused(roles, labels, message):
    with pytest.raises(ValueError, match=message):
        FeatureSpec("toy_survey", TOY.names, TOY.units, TOY.correlations, roles, labels)


def test_a_spec_says_which_features_play_which_roles_and_so_which_figures_apply():
    """Gaia's features play every role, so every figure applies; a spec without roles (as an older file's
    metadata reads) has none of the figures that read features by role, and labels its features by name
    and unit."""
    from scalable_xd.pipeline.report import figures_for

    assert GAIA_DR2.feature("colour") == "bp_rp" and GAIA_DR2.index("magnitude") == 6
    assert GAIA_DR2.feature_labels[5:] == ("BP-RP [mag]", "G [mag]")
    assert figures_for(GAIA_DR2) == ["sky_density", "denoised"]
    older = {key: value for key, value in TOY.as_dict().items() if key not in ("roles", "labels")}
    assert FeatureSpec.from_dict(older) == TOY and figures_for(TOY) == []
    assert TOY.feature_labels == ("colour [mag]", "magnitude [mag]", "distance [pc]")
    with pytest.raises(ValueError, match="toy_survey: no feature plays the role ra"):
        TOY.index("ra")
    played = FeatureSpec(
        "toy", TOY.names, TOY.units, TOY.correlations, (("colour", "colour"), ("magnitude", "magnitude"))
    )
    assert FeatureSpec.from_dict(played.as_dict()) == played and played.has("colour", "magnitude")
    assert not played.has("colour", "parallax") and figures_for(played) == []
