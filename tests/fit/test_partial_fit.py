"""``XDGMM.partial_fit``: one minibatch update per call, giving the fit of ``fit`` over the same batches in
the same order; the methods that cannot make such updates refuse it by name."""

import numpy as np
import pytest
import torch
from helpers import draw_xd_data, random_spd

from scalable_xd import XDGMM
from scalable_xd.data.inputs import data_source
from scalable_xd.fit.run.parallel import ONE_PROCESS


def _data(seed=60, n=1050, k=3, d=3):
    rng = np.random.default_rng(seed)
    weights, means, covs = rng.dirichlet(np.ones(k) * 5), rng.normal(scale=3, size=(k, d)), random_spd(rng, k, d)
    x, S, _, _ = draw_xd_data(rng, n, weights, means, covs, 0.1, 0.6)
    init = dict(weights_init=weights, means_init=means + 0.5, covariances_init=covs * 2)
    return x, S, init


def _fit_batches(x, S, batch_size: int, seed: int):
    """The batches of ``fit``'s first epoch, in its order (``Dataset.epoch_batches``)."""
    data = data_source(x, S, None, None, "X", "variance")
    batches = data.epoch_batches(batch_size, 1, seed, True, ONE_PROCESS, torch.device("cpu"), torch.float64)
    return [(b.x.numpy(), b.S.numpy()) for b in batches]


@pytest.mark.parametrize(
    "method, settings",
    [
        ("minibatch_em", {"online_regularisation": "paper"}),
        ("stochastic_minibatch_em", {"online_regularisation": "paper"}),
        ("sgd", {}),
        ("minibatch_em", {"online_regularisation": "paper", "averaging": "polyak"}),
    ],
)
def test_partial_fit_over_fits_batches_equals_the_fit(method, settings):
    """(With w in the features' units: relative to the data's variance, partial_fit takes its first batch's
    variance where fit takes all the data's.)"""
    x, S, init = _data()
    common = dict(n_components=3, method=method, batch_size=200, dtype="float64", random_state=0, **init, **settings)
    common["w_scale"] = "none"
    fitted = XDGMM(epochs=1, tol=None, **common).fit(x, Xcov=S)
    online = XDGMM(**common)
    batches = _fit_batches(x, S, 200, 0)
    for xb, Sb in batches:
        online.partial_fit(xb, Xcov=Sb)
    for attr in ("weights_", "means_", "covariances_"):
        np.testing.assert_allclose(getattr(online, attr), getattr(fitted, attr), rtol=1e-10, atol=1e-12)
    assert online.n_iter_ == len(batches) == 5 and len(online.history_) == 5


def test_partial_fit_counts_the_stars_seen_for_the_prior_and_keeps_learning():
    x, S, init = _data(seed=61, n=3000)
    model = XDGMM(3, "minibatch_em", random_state=0, **init)
    scores = []
    for start in range(0, 3000, 300):
        model.partial_fit(x[start : start + 300], Xcov=S[start : start + 300])
        scores.append(model.score(x, Xcov=S))
    assert scores[-1] > scores[0] and np.isfinite(scores).all()
    assert [h["epoch"] for h in model.history_] == list(range(1, 11))


def test_the_first_call_starts_from_k_means_on_its_batch():
    x, S, _ = _data(seed=62)
    model = XDGMM(3, "sgd", random_state=0).partial_fit(x[:500], Xcov=S[:500])
    assert model.means_.shape == (3, 3) and np.isfinite(model.means_).all()


@pytest.mark.parametrize(
    "method, options", [("em", {}), ("stochastic_em", {}), ("minibatch_em", {"split_merge": True})]
)
def test_methods_without_minibatch_updates_have_no_partial_fit(method, options):
    """As scikit-learn's ``available_if`` makes it, the attribute is absent (tools such as its estimator
    checks ask ``hasattr``); the error's own message says why (``available_if``'s says only that it "has no
    attribute", the reason hidden in its cause)."""
    x, S, _ = _data(n=100)
    model = XDGMM(3, method, **options)
    assert not hasattr(model, "partial_fit")
    with pytest.raises(AttributeError, match="partial_fit makes one minibatch update per call.*minibatch_em"):
        model.partial_fit(x, Xcov=S)
    assert XDGMM.partial_fit.__doc__.startswith("One minibatch update") and hasattr(XDGMM(3), "set_partial_fit_request")


def test_a_dataloader_feeds_partial_fit_as_its_arrays_would():
    """A ``torch.utils.data.DataLoader`` over a ``TensorDataset`` gives the fit of the same batches as
    arrays, in the same order."""
    from torch.utils.data import DataLoader, TensorDataset

    x, S, init = _data(seed=63)
    settings = dict(n_components=3, method="minibatch_em", dtype="float64", random_state=0, **init)
    from_loader, from_arrays = XDGMM(**settings), XDGMM(**settings)
    for xb, Sb in DataLoader(TensorDataset(torch.tensor(x), torch.tensor(S)), batch_size=250):
        from_loader.partial_fit(xb, Xcov=Sb)
    for start in range(0, len(x), 250):
        from_arrays.partial_fit(x[start : start + 250], Xcov=S[start : start + 250])
    np.testing.assert_array_equal(from_loader.means_, from_arrays.means_)
    np.testing.assert_array_equal(from_loader.covariances_, from_arrays.covariances_)
    assert from_loader.n_iter_ == 5  # 1,050 stars: four batches of 250 and one of 50


def test_a_bad_batch_is_named_by_its_row():
    x, S, init = _data(seed=64)
    model = XDGMM(3, "minibatch_em", random_state=0, **init).partial_fit(x[:200], Xcov=S[:200])
    bad = x[200:400].copy()
    bad[17, 1] = np.nan
    with pytest.raises(ValueError, match="17"):
        model.partial_fit(bad, Xcov=S[200:400])
    assert model.n_iter_ == 1  # the bad batch made no update


@pytest.mark.parametrize(
    "method, settings",
    [
        ("minibatch_em", {}),
        ("sgd", {}),
        ("minibatch_em", {"averaging": "polyak", "fix_means": [True, False, False]}),
        ("stochastic_minibatch_em", {"step_schedule": "cappe_moulines"}),
    ],
)
def test_save_and_load_keep_the_running_state(method, settings, tmp_path):
    """Three calls, a save and a load, two more calls: the model of five calls in one process, to the bit."""
    x, S, init = _data(seed=65)
    common = dict(n_components=3, method=method, dtype="float64", random_state=0, **init, **settings)
    whole, parted = XDGMM(**common), XDGMM(**common)
    batches = [(x[start : start + 200], S[start : start + 200]) for start in range(0, 1000, 200)]
    for xb, Sb in batches:
        whole.partial_fit(xb, Xcov=Sb)
    for xb, Sb in batches[:3]:
        parted.partial_fit(xb, Xcov=Sb)
    parted.save(tmp_path / "model.npz")
    parted = XDGMM.load(tmp_path / "model.npz")
    for xb, Sb in batches[3:]:
        parted.partial_fit(xb, Xcov=Sb)
    for attr in ("weights_", "means_", "covariances_"):
        np.testing.assert_array_equal(getattr(parted, attr), getattr(whole, attr))
    assert parted.n_iter_ == whole.n_iter_ == 5


@pytest.mark.parametrize("method, settings", [("sgd", {}), ("minibatch_em", {"online_regularisation": "paper"})])
def test_a_reload_restores_the_model_the_next_update_uses_not_a_recomputation(method, settings, tmp_path):
    """The model a fitter's next E-step uses is stored, not rebuilt from its parameters on load: the fused
    step and torch round L L^T (or the regularised covariances) alike on some CPUs and one ulp apart on
    others, so a rebuilt model would make a reloaded fit differ there. Here the stored model is nudged by
    an ulp, as another CPU's rounding would leave it, and must come back as it was."""
    x, S, init = _data(seed=68)
    model = XDGMM(3, method, dtype="float64", random_state=0, **init, **settings).partial_fit(x[:200], Xcov=S[:200])
    fitter = model._online.fitter
    nudged = fitter.mixture.covariances.clone()
    nudged[0, 0, 0] = np.nextafter(nudged[0, 0, 0].item(), np.inf)
    fitter.mixture.covariances.copy_(nudged)
    model.save(tmp_path / "model.npz")
    reloaded = XDGMM.load(tmp_path / "model.npz")._online.fitter.mixture
    assert torch.equal(reloaded.covariances, nudged)


def test_partial_fit_after_fit_goes_on_from_the_fitted_parameters():
    x, S, init = _data(seed=66)
    model = XDGMM(3, "minibatch_em", epochs=2, random_state=0, **init).fit(x, Xcov=S)
    fitted = model.means_.copy()
    model.partial_fit(x[:200], Xcov=S[:200])
    assert np.abs(model.means_ - fitted).max() < 0.5  # one small step from the fit, not a new start


def test_a_damaged_running_state_is_refused_naming_the_file(tmp_path):
    x, S, init = _data(seed=67)
    XDGMM(3, "minibatch_em", random_state=0, **init).partial_fit(x[:200], Xcov=S[:200]).save(tmp_path / "model.npz")
    with np.load(tmp_path / "model.npz") as archive:
        arrays = {key: archive[key] for key in archive.files}
    arrays["online_state"] = np.frombuffer(b"not a torch file" * 4, dtype=np.uint8)
    np.savez(tmp_path / "damaged.npz", **arrays)
    with pytest.raises(ValueError, match="damaged.npz is damaged: its arrays do not match the checksum"):
        XDGMM.load(tmp_path / "damaged.npz")


def test_set_params_between_calls_is_refused_by_name_and_a_saved_model_loads(tmp_path):
    """A running state belongs to the settings it began with: a structural change between calls is named
    and refused (it was ignored: 3 components kept under n_components=4), and the model saved after such
    a change still loads, as the fitted model it is."""
    x, S, init = _data(seed=69)
    model = XDGMM(3, "minibatch_em", random_state=0, **init)
    for start in (0, 200, 400):
        model.partial_fit(x[start : start + 200], Xcov=S[start : start + 200])
    model.set_params(n_components=4, method="sgd", means_init=None, weights_init=None, covariances_init=None)
    with pytest.raises(ValueError, match=r"partial_fit: n_components 3 -> 4, method 'minibatch_em' -> 'sgd'"):
        model.partial_fit(x[600:800], Xcov=S[600:800])
    assert model.n_iter_ == 3
    model.save(tmp_path / "model.npz")
    loaded = XDGMM.load(tmp_path / "model.npz")
    assert loaded.n_components == 3 and loaded.method == "minibatch_em"
    np.testing.assert_array_equal(loaded.means_, model.means_)
    model.set_params(n_components=3, method="minibatch_em", **init)  # set back: it goes on
    assert model.partial_fit(x[600:800], Xcov=S[600:800]).n_iter_ == 4


def test_a_projection_or_a_running_state_of_another_shape_is_named(tmp_path):
    """R projecting from another model dimension, and a model file whose running state has another K (its
    checksum recomputed, as other code would write it): named, not torch's size errors."""
    import json

    from scalable_xd.model_file import checksum

    x, S, init = _data(seed=70)
    model = XDGMM(3, "minibatch_em", random_state=0, **init).partial_fit(x[:200], Xcov=S[:200])
    R = np.broadcast_to(np.eye(3, 2), (200, 3, 2))
    with pytest.raises(ValueError, match=r"R projects from 2 model dimensions, the model has 3: R must have shape"):
        model.partial_fit(x[200:400], Xcov=S[200:400], R=R)
    other = XDGMM(2, "minibatch_em", random_state=0).partial_fit(x[:200], Xcov=S[:200])
    model.save(tmp_path / "model.npz")
    other.save(tmp_path / "other.npz")
    with np.load(tmp_path / "model.npz") as archive, np.load(tmp_path / "other.npz") as foreign:
        arrays = {key: archive[key] for key in archive.files}
        arrays["online_state"] = foreign["online_state"]
    meta = json.loads(str(arrays["meta"]))
    meta["sha256"] = checksum({key: value for key, value in arrays.items() if key != "meta"})
    np.savez(tmp_path / "mixed.npz", **{**arrays, "meta": np.array(json.dumps(meta))})
    with pytest.raises(ValueError, match=r"mixed.npz: its online_state holds a state whose .* \(2, 3, 3\), where"):
        XDGMM.load(tmp_path / "mixed.npz")
