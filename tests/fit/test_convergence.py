"""``converged_`` means what it says: the fit's last epoch changed the training log-likelihood by less than
``tol``, up or down; a minibatch method judged over its last few epochs; a fall is never convergence."""

import dataclasses
import warnings

import numpy as np
import pytest
from sklearn.exceptions import ConvergenceWarning

from scalable_xd import XDGMM
from scalable_xd.fit.driver import STOCHASTIC_WINDOW, _judged_converged
from scalable_xd.settings import FitSettings


def _history(logliks):
    return [{"epoch": e, "train_loglik": value} for e, value in enumerate(logliks)]


@pytest.mark.parametrize("method", ["minibatch_em", "sgd", "em"])
def test_a_fall_beyond_tol_is_not_convergence(method):
    settings = FitSettings(method=method, tol=1e-6, epochs=3)
    per_batch = method != "em"
    converged, warning = _judged_converged(_history([-2.0, -2.0, -2.0, -2.5]), settings, per_batch)
    assert not converged
    message, category = warning
    assert category is ConvergenceWarning and "lowered the mean training log-likelihood" in message
    assert ("step size" in message) == per_batch and ("float64" in message) == (not per_batch)
    assert message.startswith(f"{method} ended by its budget of 3 epochs while ")
    # batch EM stops at the epoch that lowered it: the warning says where, not that the budget ran out
    early = _judged_converged(_history([-2.0, -2.0, -2.0, -2.5]), dataclasses.replace(settings, epochs=100), per_batch)
    assert early[1][0].startswith(f"{method} stopped at epoch 3 while its last epoch lowered")


def test_a_minibatch_method_is_judged_on_its_last_epochs_mean_change_allowing_for_its_jitter_but_not_a_fall():
    settings = FitSettings(method="sgd", tol=1e-6, epochs=9)
    jitter = np.array([0.0, 4e-7, -3e-7, 5e-7, -2e-7, 3e-7, -1e-7])  # each epoch's change up to 7e-7 < tol
    converged, warning = _judged_converged(_history(-5 + jitter), settings, per_batch=True)
    assert converged and warning is None
    # one epoch's change of 1.5e-6 would fail tol; the mean over the window, (L_6 - L_3) / 3, does not
    last = -5 + np.array([0.0, 0.0, 0.0, 0.0, -1.0e-6, 0.5e-6, 2.0e-6])
    assert last[-1] - last[-2] > 1e-6 and abs(last[-1] - last[-1 - STOCHASTIC_WINDOW]) / STOCHASTIC_WINDOW < 1e-6
    assert _judged_converged(_history(last), settings, per_batch=True) == (True, None)
    # jitter of 3e-5 an epoch about a fixed level: no trend beyond two standard errors (sd / 3) of the mean
    wander = -5 + np.array([0.0, 0.0, 0.0, 0.0, 3e-5, -1e-5, 2e-5])
    assert _judged_converged(_history(wander), settings, per_batch=True) == (True, None)
    # flat, then a fall of 0.5: the mean change a epoch is within its (inflated) standard error, but the fall is
    # beyond tol and every change before it: the last epoch's fall is what the warning states
    converged, (message, _) = _judged_converged(_history([-2.0] * 5 + [-2.5]), settings, per_batch=True)
    assert not converged and "its last epoch lowered the mean training log-likelihood by 0.5 nats/star" in message
    # a steady fall, each epoch by about 2e-6: a trend of one sign, its mean change in the warning
    falling = -5 - 2e-6 * np.arange(7) + np.array([0, 0, 0, 0, 1e-7, 0, 0])
    converged, (message, _) = _judged_converged(_history(falling), settings, per_batch=True)
    gains = np.diff(falling)[-STOCHASTIC_WINDOW:]
    assert not converged
    assert f"lowered the mean training log-likelihood by {abs(gains.mean()):.3g} nats/star a epoch" in message
    # changes of both signs whose mean falls beyond two standard errors and tol: the warning gives both
    drifting = -5 + np.concatenate([np.zeros(4), np.cumsum([-3e-5, 1e-6, -3e-5])])
    converged, (message, _) = _judged_converged(_history(drifting), settings, per_batch=True)
    gains = np.diff(drifting)[-STOCHASTIC_WINDOW:]
    assert not converged and abs(gains.mean()) > 1e-6 + 2 * gains.std(ddof=1) / 3
    assert f"by {abs(gains.mean()):.3g} ± {gains.std(ddof=1) / 3:.2g} nats/star a epoch on average" in message


def test_tol_none_judges_nothing():
    settings = FitSettings(method="sgd", tol=None, epochs=3)
    assert _judged_converged(_history([-3.0, -2.0, -4.0]), settings, per_batch=True) == (False, None)


def test_scikit_learns_divergent_start_is_not_converged_after_its_fall():
    """scikit-learn's test_gaussian_mixture_setting_best_params (its issue 18216): a start that one update
    makes worse. Minibatch EM at w = 0 for one epoch lowers the training log-likelihood; the fit must say it has
    not converged, with a warning, as scikit-learn's GaussianMixture does."""
    X = np.random.RandomState(0).uniform(size=(30, 3))
    means = np.array(
        [
            [0.670637869618158, 0.21038256107384043, 0.12892629765485303],
            [0.09394051075844147, 0.5759464955561779, 0.929296197576212],
            [0.5033230372781258, 0.9569852381759425, 0.08654043447295741],
            [0.18578301420435747, 0.5531158970919143, 0.19388943970532435],
            [0.4548589928173794, 0.35182513658825276, 0.568146063202464],
            [0.609279894978321, 0.7929063819678847, 0.9620097270828052],
        ]
    )
    precisions = np.array([999999.999604483, 999999.9990869573, 553.7603944542167, 204.78596008931834])
    precisions = np.append(precisions, [15.867423501783637, 85.4595728389735])
    weights = np.array([1, 1, 2, 2, 21, 3]) / 30
    covariances = np.eye(3) / precisions[:, None, None]  # scikit-learn's "spherical": one variance a component
    model = XDGMM(6, "minibatch_em", w=0, epochs=1, device="cpu", dtype="float64", random_state=0)
    model.set_params(weights_init=weights, means_init=means, covariances_init=covariances)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(X, Xcov=np.zeros((30, 3)))
    before, after = (entry["train_loglik"] for entry in model.history_)
    assert after < before - 0.1  # the case: the epoch lowered it
    assert not model.converged_
    said = [str(w.message) for w in caught if issubclass(w.category, ConvergenceWarning)]
    assert any("lowered the mean training log-likelihood" in text for text in said), said
