"""``scalable_xd.fit_together``: several estimators fitted to one data set end as each ends alone (to the bit on
the CPU: the lockstep's passes and updates are each fit's own arithmetic, ``tests/fit/test_lockstep.py``), keep
their own checkpoints, and are refused where they differ in more than their seed and start."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from sklearn.base import clone
from sklearn.exceptions import ConvergenceWarning

from scalable_xd import XDGMM, fit_together, steps_together

RNG = np.random.default_rng(7)
N, D, K = 1500, 3, 4


def _data():
    centres = RNG.normal(scale=4.0, size=(K, D))
    X = centres[RNG.integers(K, size=N)] + RNG.normal(size=(N, D))
    variances = RNG.uniform(0.05, 0.5, (N, D))
    return X + RNG.normal(size=(N, D)) * np.sqrt(variances), variances


X, VARIANCES = _data()


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")  # three epochs, alone
@pytest.mark.parametrize("method", ["em", "minibatch_em", "sgd"])
def test_each_fit_together_is_its_fit_alone(method):
    base = XDGMM(K, method, epochs=3, n_init=1, dtype="float64")
    seeds = [3, 4, 5]
    together = [clone(base).set_params(random_state=s) for s in seeds]
    assert steps_together(together) == (method != "em")  # batch EM's fits one after another
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert fit_together(together, X, Xcov=VARIANCES, X_val=X[:300], Xcov_val=VARIANCES[:300]) == together
    # three epochs: each fit warns that it has not converged, at this line, naming its model
    assert sorted(str(w.message)[:10] for w in said) == [f"models[{i}]:" for i in range(3)]
    assert {(w.category, w.filename) for w in said} == {(ConvergenceWarning, __file__)}
    for seed, model in zip(seeds, together):
        alone = (
            clone(base).set_params(random_state=seed).fit(X, Xcov=VARIANCES, X_val=X[:300], Xcov_val=VARIANCES[:300])
        )
        for name in ("weights_", "means_", "covariances_"):
            assert np.array_equal(getattr(model, name), getattr(alone, name)), (seed, name)
        assert [h["val_loglik"] for h in model.history_] == [h["val_loglik"] for h in alone.history_]


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")  # two epochs
def test_fits_together_resume_each_from_its_own_checkpoint(tmp_path):
    """A checkpoint a fit: a rerun reads each back (no further epoch), and each ends as it ended."""
    models = [XDGMM(K, "minibatch_em", epochs=2, n_init=1, random_state=s) for s in (0, 1)]
    paths = [tmp_path / "a.ckpt", tmp_path / "b.ckpt"]
    fit_together(models, X, Xcov=VARIANCES, checkpoints=paths)
    assert all(path.exists() for path in paths)
    again = [clone(model) for model in models]
    fit_together(again, X, Xcov=VARIANCES, checkpoints=paths)
    for first, second in zip(models, again):
        assert np.array_equal(first.means_, second.means_) and first.n_iter_ == second.n_iter_


def test_a_fit_that_fails_stops_the_others_and_is_raised():
    bad = XDGMM(K, "minibatch_em", epochs=2, n_init=1, means_init=np.full((K, D + 1), 0.0), random_state=1)
    models = [XDGMM(K, "minibatch_em", epochs=2, n_init=1, random_state=0), bad]
    with pytest.raises(ValueError, match="means_init"):
        fit_together(models, X, Xcov=VARIANCES)


def test_refusals_name_the_model_and_setting():
    one = XDGMM(K, "minibatch_em", random_state=0)
    with pytest.raises(ValueError, match=r"models\[1\]\.method = 'sgd' but models\[0\]\.method = 'minibatch_em'"):
        fit_together([one, XDGMM(K, "sgd")], X, Xcov=VARIANCES)
    with pytest.raises(ValueError, match=r"models\[1\]\.n_components = 5"):
        fit_together([one, XDGMM(5, "minibatch_em")], X, Xcov=VARIANCES)
    with pytest.raises(ValueError, match="listed twice"):
        fit_together([one, one], X, Xcov=VARIANCES)
    with pytest.raises(TypeError, match=r"models\[1\]: an XDGMM"):
        fit_together([one, "model"], X, Xcov=VARIANCES)
    with pytest.raises(ValueError, match="empty list"):
        fit_together([], X)
    with pytest.raises(ValueError, match="1 for 2 models"):
        fit_together([one, clone(one)], X, Xcov=VARIANCES, checkpoints=["a.ckpt"])
    with pytest.raises(ValueError, match="share a checkpoint"):
        fit_together([one, clone(one)], X, Xcov=VARIANCES, checkpoints=["a.ckpt", "./a.ckpt"])
