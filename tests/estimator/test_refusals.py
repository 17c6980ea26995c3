"""Every refusal of a fit's settings, start or options is raised before any work: no k-means has run and
no statistics pass (counted by spies on the k-means, the general pass's chunks and the CPU's plain pass)."""

import re

import numpy as np
import pytest

from scalable_xd import XDGMM
from scalable_xd.fit.starts import mixture as starts
from scalable_xd.kernel import dispatch, fused

RNG = np.random.default_rng(0)
X = RNG.normal(size=(600, 2))
S = np.tile(np.eye(2) * 0.1, (600, 1, 1))


def refusal(message: str, fit: dict | None = None, **settings) -> tuple:
    """A case: the settings, the fit's keyword arguments and the start of the message that refuses them."""
    return settings, fit or {}, message


R = np.tile(np.eye(2), (600, 1, 1))
# Every rule a fit's settings, start and options are checked by, one case each.
REFUSALS = {
    "split_merge keeps no fixed means": refusal(
        "split_merge moves", method="minibatch_em", split_merge=True, fix_means=True
    ),
    "nor fixed weights": refusal("split_merge moves", method="em", split_merge=True, fix_weights=True),
    "nor a fixed covariance": refusal(
        "split_merge moves", method="sgd", split_merge=True, fix_covariances=[True, False]
    ),
    "the naive update keeps no fixed parameters": refusal(
        "fixed parameters need", method="minibatch_em", covariance_update="naive", fix_means=True
    ),
    "batch EM is not averaged": refusal("averaging='polyak'", method="em", averaging="polyak"),
    "SGD is not truncated": refusal("truncation applies", method="sgd", truncation=True),
    "split_merge is not averaged": refusal(
        "split_merge works", method="minibatch_em", split_merge=True, averaging="polyak"
    ),
    "split_merge after convergence needs tol": refusal("split_merge with", method="em", split_merge=True, tol=None),
    "a background without split_merge": refusal(
        "background: not with split", method="em", background="auto", split_merge=True
    ),
    "a selection's EM judged by tol": refusal("selection: tol=0.001", method="em", selection="x0 < 1", tol=1e-3),
    "a background without projections": refusal(
        "background: not with proj", dict(R=R), method="em", background="auto", acceleration="none"
    ),
    "checkpoints inside epochs need a path": refusal("checkpoint_every", dict(checkpoint_every=3), method="sgd"),
    "split_merge checkpoints at epochs' ends": refusal(
        "checkpoint_every", dict(checkpoint_every=3, checkpoint="unused.ckpt"), method="sgd", split_merge=True
    ),
    "an unknown backend": refusal("unknown backend", backend="nope"),
    "an unknown device": refusal("unknown device", device="tpu"),
    "more components than points": refusal("n_components=601", n_components=601),
    "means_init of another shape": refusal("means_init must have shape", means_init=np.zeros((3, 2))),
    "weights_init not positive": refusal(
        "weights_init must lie in (0, 1]: component 0's is 0", weights_init=[0.0, 1.0]
    ),
    "weights_init above 1": refusal("component 0's is 1.5", weights_init=[1.5, -0.5]),
    "weights_init not normalised": refusal(
        "weights_init must sum to 1 (within 1e-06), got 0.9", weights_init=[0.5, 0.4]
    ),
    "covariances_init not symmetric": refusal(
        "covariances_init component 1 is not symmetric",
        covariances_init=np.array([np.eye(2), [[1.0, 0.5], [0.0, 1.0]]]),
    ),
    "weights_init of another shape": refusal("weights_init must have shape", weights_init=[1.0]),
    "covariances_init not positive definite": refusal(
        "covariances_init component 1", covariances_init=np.array([np.eye(2), -np.eye(2)])
    ),
    "a selection's limits misspelt": refusal("selection:", method="em", selection="x0:-1:1"),
    "fixed masks of another length": refusal("fix_means must be", fix_means=[True]),
    "an unknown missing-data rule": refusal("unknown missing", missing="drop"),
    "restarts need fresh starts": refusal("n_init=2: warm_start continues", n_init=2, warm_start=True),
    "kappa outside (0.5, 1]": refusal("kappa", method="minibatch_em", step_schedule="cappe_moulines", kappa=0.3),
}


@pytest.fixture
def work(monkeypatch):
    """The names of the k-means and passes that ran."""
    ran = []
    for owner, name in ((starts, "minibatch_kmeans"), (dispatch, "_chunk"), (fused.PlainPass, "_pass")):
        original = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, _f=original, _n=name, **k: ran.append(_n) or _f(*a, **k))
    return ran


@pytest.mark.parametrize("case", REFUSALS)
def test_every_refusal_is_raised_before_any_kmeans_or_pass(case, work, tmp_path, monkeypatch):
    settings, fit_kwargs, message = REFUSALS[case]
    settings = {"n_components": 2, **settings}
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=re.escape(message)):
        XDGMM(random_state=0, epochs=2, **settings).fit(X, Xcov=S, **fit_kwargs)
    assert work == []


def test_the_spies_see_a_fits_kmeans_and_passes(work):
    XDGMM(2, random_state=0, epochs=1).fit(X, Xcov=S)
    assert {"minibatch_kmeans", "_chunk"} <= set(work) or {"minibatch_kmeans", "_pass"} <= set(work)


def test_a_covariance_singular_to_working_precision_is_refused_whether_or_not_it_factorises():
    """Correlation 1 - 2^-53: torch's Cholesky factorises it (its pivot 1 - a^2 rounds to 2^-52, above 0),
    but a variance of 2.2e-16 of the feature's, given the other, is float64's resolution: whether such a
    factorisation succeeds is decided by rounding, so by the CPU. Judged on the unit-diagonal pivots it is
    refused alike everywhere; correlation 1 - 2^-40 (pivot 1.8e-12) is a valid, if narrow, covariance."""
    import torch

    from scalable_xd.mixture import Mixture

    def mixture(correlation: float, scale: float) -> Mixture:
        cov = torch.tensor([[1.0, correlation], [correlation, 1.0]], dtype=torch.float64)
        cov = cov * torch.tensor([1.0, scale]).sqrt()[:, None] * torch.tensor([1.0, scale]).sqrt()[None, :]
        return Mixture(torch.ones(1, dtype=torch.float64), torch.zeros(1, 2, dtype=torch.float64), cov[None])

    for scale in (1.0, 1e-8, 1e6):  # the features' units do not matter
        edge = mixture(1 - 2.0**-53, scale)
        if scale == 1.0:  # 1 - a^2 is 2^-52 with or without a fused multiply-add: the plain factorisation passes
            assert int(torch.linalg.cholesky_ex(edge.covariances)[1][0]) == 0
        assert edge.first_invalid_component() == (
            0,
            "has a covariance that is not positive definite (singular to working precision)",
        )
        assert mixture(1 - 2.0**-40, scale).first_invalid_component() is None
