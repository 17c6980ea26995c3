"""Each figure's content, read from what the plotting function drew (not from pixels)."""

import healpy as hp
import numpy as np
import pytest

from scalable_xd.fit.methods import METHODS
from scalable_xd.pipeline.cli import main
from scalable_xd.pipeline.features_file import read_features
from scalable_xd.pipeline.report.figures import LAST_EPOCHS, plot_corner, plot_timing_vs_k, plot_training_curves
from scalable_xd.pipeline.report.metrics import FitMetrics
from scalable_xd.pipeline.report.sky import density_map, plot_sky_density, resolution
from scalable_xd.pipeline.report.style import COLUMN_HEIGHT, legend_columns, legend_height

EPOCHS = 12


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny run through the CLI: a 4,000-star mock, its splits, and every method at K = 3 for two seeds."""
    root = tmp_path_factory.mktemp("figures")
    assert main(["-q", "mock", "--n-rows", "4000", "--seed", "2", "--output", str(root / "raw.parquet")]) == 0
    assert main(["-q", "features", "--input", str(root / "raw.parquet"), "--out-dir", str(root / "data")]) == 0
    metrics = []
    for seed in (0, 1):
        init = root / f"init{seed}.npz"
        assert (
            main(
                [
                    "-q",
                    "kmeans",
                    "--train",
                    str(root / "data" / "train.parquet"),
                    "--n-components",
                    "3",
                    "--seed",
                    str(seed),
                    "--output",
                    str(init),
                ]
            )
            == 0
        )
        for method in list(METHODS):
            out = root / method / f"seed{seed}"
            assert (
                main(
                    [
                        "-q",
                        "fit",
                        "--train",
                        str(root / "data" / "train.parquet"),
                        "--val",
                        str(root / "data" / "val.parquet"),
                        "--init",
                        str(init),
                        "--n-components",
                        "3",
                        "--method",
                        method,
                        "--seed",
                        str(seed),
                        "--epochs",
                        str(EPOCHS),
                        "--tol",
                        "none",
                        "--step-schedule",
                        "step",
                        "--step-size",
                        "0.05",
                        "--device",
                        "cpu",
                        "--output-model",
                        str(out / "model.npz"),
                        "--output-metrics",
                        str(out / "metrics.json"),
                    ]
                )
                == 0
            )
            metrics.append(out / "metrics.json")
    return root, metrics


def test_the_sky_map_integrates_to_the_number_of_stars():
    rng = np.random.default_rng(0)
    lon, lat = rng.uniform(0, 360, 5000), np.degrees(np.arcsin(rng.uniform(-1, 1, 5000)))
    for nside in (4, 16):
        density = density_map(lon, lat, nside)
        assert density.sum() * hp.nside2pixarea(nside, degrees=True) == pytest.approx(5000)
    # uniform on the sphere: every pixel near the mean density, 5000 / 41253 per square degree
    assert np.median(density_map(lon, lat, 4)) == pytest.approx(5000 / (4 * np.pi * (180 / np.pi) ** 2), rel=0.15)
    # 5,000 uniform stars leave no 54 sq. deg pixel (nside 8) empty, but many 13 sq. deg ones (nside 16)
    assert resolution(lon, lat) == 8 and resolution(lon[:10], lat[:10]) == 2


@pytest.mark.slow
@pytest.mark.parametrize("frame", ["icrs", "galactic"])
def test_sky_figure_shows_data_and_model_on_one_scale(run, tmp_path, frame):
    root, _ = run
    out = plot_sky_density(
        root / "minibatch_em" / "seed0" / "model.npz",
        root / "data" / "train.parquet",
        [tmp_path / "sky.png", tmp_path / "sky.pdf"],
        n_samples=20_000,
        frame=frame,
    )
    assert "K = 3 Minibatch EM\n" in out["titles"]["model"]  # without metrics, the model's method
    area = hp.nside2pixarea(out["nside"], degrees=True)
    n_train = len(read_features(root / "data" / "train.parquet").X)
    assert out["maps"]["data"].sum() * area == pytest.approx(n_train)
    assert out["maps"]["model"].sum() * area == pytest.approx(n_train * out["on_sky"])  # scaled to the data
    shown = np.concatenate([m[m > 0] for m in out["maps"].values()])
    assert out["norm"].vmin == shown.min() and out["norm"].vmax == shown.max()
    assert (tmp_path / "sky.pdf").read_bytes().startswith(b"%PDF")


def test_time_error_bars_stay_positive_and_every_method_is_drawn(run, tmp_path):
    _, metrics = run
    drawn = plot_timing_vs_k(metrics, [tmp_path / "timing.png"])
    assert list(drawn) == list(METHODS)
    for method, bars in drawn.items():
        assert (
            (bars["low"] > 0).all() and (bars["low"] <= bars["centre"]).all() and (bars["centre"] <= bars["high"]).all()
        )
        histories = [FitMetrics.read(p).history for p in metrics if f"/{method}/" in str(p)]
        paced = [np.median(np.diff([e["seconds"] for e in h])) * (len(h) - 1) for h in histories]  # median epoch
        assert bars["centre"][0] == pytest.approx(np.exp(np.mean(np.log(paced))))  # the geometric mean


def test_a_seed_fitted_in_lockstep_is_not_timed_as_one_fit(run, tmp_path):
    """A seed fitted with others (``timed_by``) carries another seed's pace: the figure leaves it out."""
    _, metrics = run
    lockstep = []
    for path in metrics:
        m = FitMetrics.read(path)
        if m.seed == 1:  # its history made ten times slower, as if its clock counted nine other fits
            m.timed_by, m.history = 0, [{**e, "seconds": 10 * e["seconds"]} for e in m.history]
            path = tmp_path / f"{m.method}_lockstep.json"
            m.write(path)
        lockstep.append(path)
    alone = [p for p in metrics if FitMetrics.read(p).seed == 0]
    drawn = plot_timing_vs_k(lockstep, [tmp_path / "timing.png"])
    for method, bars in drawn.items():
        assert bars["centre"] == pytest.approx(plot_timing_vs_k(alone, [tmp_path / "alone.png"])[method]["centre"])
        assert bars["label"].endswith(" (timed: 1 of 2 seeds)")  # its bars cover one fit, and it says so


@pytest.mark.parametrize("limits", [(1.2, 4.8), (0.8, 6.0), (0.5, 40.0), (0.01, 300.0)])
def test_a_log_axis_labels_at_least_three_values_in_any_range(limits):
    from matplotlib.ticker import LogLocator

    from scalable_xd.pipeline.report.figures import _log_subs

    ticks = LogLocator(subs=_log_subs(limits)).tick_values(*limits)
    inside = ticks[(ticks >= limits[0]) & (ticks <= limits[1])]
    assert 3 <= len(inside) <= 12, (limits, inside)


def test_curves_show_the_last_epochs_of_every_method(run, tmp_path):
    _, metrics = run
    drawn = plot_training_curves(metrics, [tmp_path / "curves.png"], n_components=3)
    low, high = drawn["ylim"]
    for path in metrics:
        history = FitMetrics.read(path).history
        assert len(history) == EPOCHS + 1
    for method in list(METHODS):
        curves = np.array(
            [[e["train_loglik"] for e in FitMetrics.read(p).history] for p in metrics if f"/{method}/" in str(p)]
        )
        last = curves.mean(axis=0)[-LAST_EPOCHS:]
        assert low <= last.min() and last.max() <= high, method
    start = np.mean([FitMetrics.read(p).history[0]["train_loglik"] for p in metrics])
    assert start < low  # the k-means start is below the axis, as the title says


def test_corner_names_every_layer_and_the_mass_beyond_the_panels(run, tmp_path):
    root, _ = run
    drawn = plot_corner(
        root / "sgd" / "seed0" / "model.npz",
        root / "data" / "test.parquet",
        [tmp_path / "corner.png", tmp_path / "corner.pdf"],
        n_samples=5000,
    )
    assert [label.split(":")[0] for label in drawn["legend"]] == ["data", "model", "true values"]
    assert all(0 <= share <= 1 for share in drawn["outside"].values()) and "G [mag]" in drawn["outside"]
    assert drawn["title"] == "SGD, K = 3"


@pytest.mark.slow
def test_a_variants_corner_and_sky_figures_name_it_by_what_sets_it_apart(run, tmp_path):
    """A workflow variant's corner plot and sky figure name it as its metrics do, not by its method alone
    (the demo's selection-aware fit was titled "Batch EM (Bovy et al. 2011)"; converge.yaml's sky figure
    draws the variant minibatch_em_defaults)."""
    root, metrics = run
    m = FitMetrics.read(metrics[0])
    m.method, m.settings = "em_cut_aware", {**m.settings, "method": "em", "selection": "x0 < 1"}
    m.write(tmp_path / "metrics.json")
    drawn = plot_corner(
        root / "sgd" / "seed0" / "model.npz",
        root / "data" / "test.parquet",
        [tmp_path / "corner.png"],
        n_samples=2000,
        metrics_path=tmp_path / "metrics.json",
    )
    assert drawn["title"] == "Batch EM, cut to x0 < 1 (aware), K = 3"
    sky = plot_sky_density(
        root / "minibatch_em" / "seed0" / "model.npz",
        root / "data" / "train.parquet",
        [tmp_path / "sky.png"],
        n_samples=2000,
        metrics_path=tmp_path / "metrics.json",
    )
    assert "K = 3 Batch EM, cut to x0 < 1 (aware)\n" in sky["titles"]["model"]


def test_a_cut_is_named_by_the_features_labels_and_naive_and_aware_keep_their_colours(run, tmp_path):
    """A cut reads as the survey labels its features ("G < 20", not "phot_g_mean_mag < 20"), and the naive
    and aware fits are drawn in the selection's two colours, in the corner and timing figures alike, apart
    from every method's (both drew in batch EM's blue; the selection figure used minibatch EM's orange)."""
    from scalable_xd.pipeline.gaia.schema import GAIA_DR2
    from scalable_xd.pipeline.report.style import LOOKS, SELECTION_COLOURS, readable_selection

    assert readable_selection("phot_g_mean_mag < 20", GAIA_DR2.names, GAIA_DR2.feature_labels) == "G < 20"
    assert readable_selection("(bp_rp > 0.5) & (x2 < 1e3)", GAIA_DR2.names, GAIA_DR2.feature_labels) == (
        "(BP-RP > 0.5) & (x2 < 1e3)"
    )
    root, metrics = run
    paths, colours = [], {}
    for role, aware in (("naive", False), ("aware", True)):
        m = FitMetrics.read(metrics[0])
        settings = {"method": "em", "selection": "x0 < 1", "selection_aware": aware, "selection_label": "G < 1"}
        m.method, m.settings = f"em_cut_{role}", {**m.settings, **settings}
        path = tmp_path / f"{role}.json"
        m.write(path)
        paths.append(path)
        corner = plot_corner(
            root / "em" / "seed0" / "model.npz",
            root / "data" / "test.parquet",
            [tmp_path / f"corner_{role}.png"],
            n_samples=2000,
            metrics_path=path,
        )
        assert corner["title"] == f"Batch EM, cut to G < 1 ({role}), K = 3"
        colours[role] = corner["colour"]
    assert colours == SELECTION_COLOURS and not set(colours.values()) & {look[1] for look in LOOKS.values()}
    timing = plot_timing_vs_k([*metrics, *paths], [tmp_path / "timing.png"])
    assert {role: timing[f"em_cut_{role}"]["colour"] for role in colours} == SELECTION_COLOURS


def test_the_corner_caption_holds_noise_broadens_the_data(run):
    """The caption says the data are broader than the true values where the noise is large."""
    root, _ = run
    test = read_features(root / "data" / "test.parquet")
    complete = test.n_missing == 0
    for k in (2, 3, 4):  # parallax, pmra, pmdec
        assert test.X[complete, k].std() > test.true[complete, k].std()


def test_a_fit_under_a_selection_does_not_share_the_training_curves(run, tmp_path):
    """A cut variant scores other stars, on another scale (-17 nats where the others are at -28 on the
    demo): drawn beside them it squashed their curves and bands. It is left out where others are drawn."""
    _, metrics = run
    plain = plot_training_curves(metrics, [tmp_path / "plain.png"], 3)
    m = FitMetrics.read(metrics[0])
    m.method, m.settings = "em_cut", {**m.settings, "selection": "x0 < 1"}
    m.history = [{**e, "train_loglik": e["train_loglik"] + 10} for e in m.history]
    m.write(tmp_path / "cut.json")
    with_cut = plot_training_curves([*metrics, tmp_path / "cut.json"], [tmp_path / "with_cut.png"], 3)
    assert with_cut == plain
    alone = plot_training_curves([tmp_path / "cut.json"], [tmp_path / "alone.png"], 3)
    assert (alone["methods"], alone["labels"]) == (["em_cut"], ["Batch EM, cut to x0 < 1 (aware)"])


def test_a_legend_takes_as_many_columns_as_fit_across_the_figure():
    """The paper's three methods side by side in two columns; a workflow's cut variants, named by what they
    are, each a row of their own (side by side they ran off both edges of a one-column figure), the figure
    taller by their rows so that its axes keep their height."""
    paper = ["Batch EM (Bovy et al. 2011)", "Minibatch EM", "SGD"]
    cut = ["Batch EM, cut to phot_g_mean_mag < 20 (naive)", "Batch EM, cut to phot_g_mean_mag < 20 (aware)"]
    assert (legend_columns(paper, 2), legend_columns(paper, 3)) == (2, 3)
    assert legend_columns(paper + cut, 2) == 1
    assert legend_height(len(paper), 2) == COLUMN_HEIGHT and legend_height(len(paper + cut), 1) > COLUMN_HEIGHT
