"""Split-and-merge EM: the moves' arithmetic by hand, escape from the classic traps, and the bookkeeping."""

import numpy as np
import pytest
import torch

from scalable_xd import XDGMM
from scalable_xd.fit.families.split_merge import apply_move, ranked_moves, split_scores
from scalable_xd.kernel.statistics import Criteria
from scalable_xd.mixture import Mixture

CENTRES = np.array([[0.0, 0.0], [6.0, 0.0], [6.0, 6.0]])


@pytest.fixture(scope="module")
def three_clusters():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(size=(1000, 2)) * 0.5 + c for c in CENTRES])
    return x, np.full((3000, 2), 0.01)


# Two components inside the first cluster and one straddling the other two: EM's classic local optimum.
TRAP = dict(
    means_init=np.array([[-0.3, 0.0], [0.3, 0.0], [6.0, 3.0]]),
    covariances_init=np.stack([np.eye(2) * 0.3] * 2 + [np.eye(2) * 4.0]),
)


def _recovered(model, within: float = 0.1) -> bool:
    """Every true centre has a fitted mean within ``within``."""
    return all(np.linalg.norm(model.means_ - c, axis=1).min() < within for c in CENTRES)


def test_em_stays_trapped_and_split_and_merge_escapes(three_clusters):
    x, S = three_clusters
    settings = dict(n_components=3, method="em", epochs=80, device="cpu", dtype="float64", **TRAP)
    plain = XDGMM(**settings).fit(x, Xcov=S)
    moved = XDGMM(**settings, split_merge=True, split_merge_tries=2).fit(x, Xcov=S)
    assert not _recovered(plain) and _recovered(moved)
    assert moved.score(x, Xcov=S) > plain.score(x, Xcov=S) + 0.5
    assert moved.history_[-1]["moves_accepted"] >= 1
    # the reported model never loses log-likelihood: EM is monotone, a move is kept only if it gains
    curve = np.array([h["train_loglik"] for h in moved.history_])
    assert (np.diff(curve) >= -1e-9).all()


def test_the_straddling_start_of_two_means_in_one_cluster_is_escaped():
    """Two true components, both initial means in the first: K = 3 so a merge and a split exist."""
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.normal(size=(1500, 2)) * 0.4, rng.normal(size=(1500, 2)) * 0.4 + [5.0, 0.0]])
    start = dict(means_init=np.array([[-0.2, 0.0], [0.2, 0.0], [0.0, 0.3]]), covariances_init=np.stack([np.eye(2)] * 3))
    plain = XDGMM(3, "em", epochs=200, acceleration="none", device="cpu", dtype="float64", **start).fit(x, Xcov=None)
    moved = XDGMM(3, "em", epochs=200, device="cpu", dtype="float64", split_merge=True, **start).fit(x, Xcov=None)
    assert moved.score(x, Xcov=None) >= plain.score(x, Xcov=None) - 1e-9
    assert np.linalg.norm(moved.means_ - [5.0, 0.0], axis=1).min() < 0.1


def test_the_moves_keep_the_moments_by_hand():
    weights = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    means = torch.tensor([[0.0, 1.0], [2.0, -1.0], [5.0, 5.0]], dtype=torch.float64)
    covs = torch.tensor(
        [[[1.0, 0.2], [0.2, 0.5]], [[0.3, 0.0], [0.0, 0.7]], [[4.0, 1.0], [1.0, 2.0]]], dtype=torch.float64
    )
    q = torch.tensor([20.0, 60.0, 100.0], dtype=torch.float64)
    moved = apply_move(Mixture(weights, means, covs), q, (0, 1, 2))
    np.testing.assert_allclose(moved.weights.numpy(), [0.5, 0.25, 0.25])
    # merged: the q-weighted mixture of components 0 and 1, its mean and covariance by hand
    share = np.array([0.25, 0.75])
    mean = share @ means[:2].numpy()
    cov = sum(s * (c + np.outer(m - mean, m - mean)) for s, m, c in zip(share, means[:2].numpy(), covs[:2].numpy()))
    np.testing.assert_allclose(moved.means[0].numpy(), mean, rtol=1e-14)
    np.testing.assert_allclose(moved.covariances[0].numpy(), cov, rtol=1e-14)
    # split: an equal mixture of the halves has component 2's mean and covariance; halves are positive definite
    halves_mean = 0.5 * (moved.means[1] + moved.means[2])
    spread = 0.25 * torch.outer(moved.means[1] - moved.means[2], moved.means[1] - moved.means[2])
    np.testing.assert_allclose(halves_mean.numpy(), means[2].numpy(), rtol=1e-14)
    np.testing.assert_allclose((moved.covariances[1] + spread).numpy(), covs[2].numpy(), rtol=1e-13)
    assert torch.linalg.eigvalsh(moved.covariances[1]).min() > 0


def test_moves_are_ranked_by_overlap_then_local_divergence():
    q = torch.tensor([10.0, 10.0, 10.0, 10.0], dtype=torch.float64)
    overlap = torch.zeros(4, 4, dtype=torch.float64)
    overlap[1, 3], overlap[0, 2] = 5.0, 3.0
    r_log_n = -torch.tensor([1.0, 4.0, 2.0, 3.0], dtype=torch.float64) * q  # divergences 1, 4, 2, 3 (+ const)
    criteria = Criteria(overlap, torch.zeros(4, dtype=torch.float64), r_log_n)
    np.testing.assert_allclose(split_scores(criteria, q).numpy(), [1.0, 4.0, 2.0, 3.0] - np.log(10.0))
    assert ranked_moves(criteria, q, 4) == [(1, 3, 2), (1, 3, 0), (0, 2, 1), (0, 2, 3)]


@pytest.fixture(scope="module")
def shuffled_clusters():
    rng = np.random.default_rng(2)
    x = np.concatenate([rng.normal(size=(4000, 2)) * 0.5 + c for c in CENTRES])
    return rng.permutation(x), np.full((12_000, 2), 0.01)


@pytest.mark.parametrize("method", ["minibatch_em", "stochastic_minibatch_em", "sgd"])
def test_the_stochastic_form_escapes_the_trap_for_every_minibatch_method(shuffled_clusters, method):
    x, S = shuffled_clusters
    settings = dict(
        n_components=3,
        method=method,
        epochs=8,
        batch_size=200,
        lr=0.05,
        device="cpu",
        dtype="float64",
        random_state=0,
        **TRAP,
    )
    plain = XDGMM(**settings).fit(x, Xcov=S)
    moved = XDGMM(**settings, split_merge=True).fit(x, Xcov=S)
    within = 0.3 if method == "sgd" else 0.1  # Adam at a fixed learning rate jitters around the optimum
    assert not _recovered(plain, within) and _recovered(moved, within)
    # every judged move: kept exactly when the trial scored higher on the judging sample
    for before, after in zip(moved.history_, moved.history_[1:]):
        if after["moves_tried"] > before["moves_tried"]:
            incumbent, trial = after["last_judged"]
            assert (after["moves_accepted"] > before["moves_accepted"]) == (trial > incumbent)


def test_a_validation_set_judges_the_stochastic_moves(shuffled_clusters):
    """With X_val given, a move is judged on it: after each judgement the epoch's validation score (of the
    model kept) is the higher of the two judged scores."""
    x, S = shuffled_clusters
    model = XDGMM(
        3,
        "minibatch_em",
        epochs=4,
        batch_size=200,
        split_merge=True,
        device="cpu",
        dtype="float64",
        random_state=0,
        **TRAP,
    )
    model.fit(x[:10_000], Xcov=S[:10_000], X_val=x[10_000:], Xcov_val=S[10_000:])
    judged = [
        after
        for before, after in zip(model.history_, model.history_[1:])
        if after["moves_tried"] > before["moves_tried"]
    ]
    assert judged
    for entry in judged:
        assert entry["val_loglik"] == pytest.approx(max(entry["last_judged"]), rel=1e-12)


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(method="em", split_merge=True, tol=None), "split_merge with method 'em' needs a positive tolerance"),
        (dict(method="em", split_merge=True, tol=0.0), "which tol = 0.0 never declares"),
        (dict(method="em", split_merge=True, fix_means=True), "cannot keep fixed parameters"),
        (dict(method="minibatch_em", split_merge=True, fix_means=True), "cannot keep fixed parameters"),
        (dict(method="minibatch_em", split_merge=True, averaging="polyak"), "without averaging or truncation"),
        (dict(method="stochastic_em", split_merge=True), "split_merge works with em, minibatch_em"),
        (dict(method="em", split_merge=True, split_merge_tries=0), "split_merge_tries must be a positive integer"),
    ],
)
def test_bad_split_merge_settings_are_named(three_clusters, settings, message):
    with pytest.raises(ValueError, match=message):
        x, S = three_clusters
        XDGMM(3, device="cpu", **settings).fit(x, Xcov=S)
