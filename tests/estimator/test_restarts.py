"""Restarts (``n_init``): start s is the fit of seed random_state + s; the best start is kept by its final
validation (else training) log-likelihood, every start's score recorded; a run killed inside a start
resumes it and reads back the starts already done."""

import warnings

import numpy as np
import pytest

import scalable_xd.fit.plan
import scalable_xd.fit.restarts
import scalable_xd.fit.run.checkpoint
from scalable_xd import XDGMM, FitDivergedError

RNG = np.random.default_rng(3)
X = np.concatenate(
    [RNG.normal(size=(500, 2)), RNG.normal(size=(500, 2)) * 0.5 + [4, 4], RNG.normal(size=(300, 2)) * 0.3 + [-3, 4]]
)
S = np.tile(np.eye(2) * 0.05, (len(X), 1, 1))
SETTINGS = dict(n_components=3, epochs=5, dtype="float64", device="cpu")

pytestmark = pytest.mark.default_starts  # the default's own three starts (tests/conftest.py)


def _separate(method: str, seeds, **fit_kwargs) -> list[XDGMM]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # short budgets: ConvergenceWarning
        return [XDGMM(method=method, random_state=s, n_init=1, **SETTINGS).fit(X, Xcov=S, **fit_kwargs) for s in seeds]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["em", "minibatch_em", "sgd"])
def test_the_best_of_n_starts_is_the_best_of_the_separate_seeded_fits_to_the_bit(method):
    """Each start is its seed's fit, bit for bit (the same code on the same data: no tolerance)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = XDGMM(method=method, n_init=4, random_state=10, **SETTINGS).fit(X, Xcov=S)
    separate = _separate(method, range(10, 14))
    scores = [m.history_[-1]["train_loglik"] for m in separate]
    assert model.start_scores_ == scores and model.best_start_ == int(np.argmax(scores))
    best = separate[model.best_start_]
    for name in ("weights_", "means_", "covariances_"):
        assert np.array_equal(getattr(model, name), getattr(best, name)), name
    untimed = lambda history: [{k: v for k, v in e.items() if k not in ("seconds", "cpu_seconds")} for e in history]  # noqa: E731
    assert untimed(model.history_) == untimed(best.history_)


@pytest.mark.parametrize("method", ["minibatch_em", "sgd"])
def test_starts_fitted_in_groups_keep_only_the_best_and_end_as_the_separate_fits(method, monkeypatch, caplog):
    """n_init = 5 in groups of 2 (STARTS_AT_ONCE): groups of 2, 2 and 1 starts, every discarded start's fit
    released once its group is judged (so memory does not grow with n_init: 10**6 starts at once grew past
    2 GB), and the same best start, scores and parameters as the separate fits, to the bit."""
    import gc
    import weakref

    monkeypatch.setattr(scalable_xd.fit.restarts, "STARTS_AT_ONCE", 2)
    groups, fitted = [], []

    def recorded(plans):
        fits = fit_together(plans)
        groups.append(len(plans))
        fitted.extend(weakref.ref(f) for f in fits)
        return fits

    fit_together = scalable_xd.fit.restarts.fit_together
    monkeypatch.setattr(scalable_xd.fit.restarts, "fit_together", recorded)
    with warnings.catch_warnings(), caplog.at_level("INFO", logger="scalable_xd.fit"):
        warnings.simplefilter("ignore")
        model = XDGMM(method=method, n_init=5, random_state=10, **SETTINGS).fit(X, Xcov=S)
    gc.collect()
    assert groups == [2, 2, 1] and sum(ref() is not None for ref in fitted) == 0
    separate = _separate(method, range(10, 15))
    scores = [m.history_[-1]["train_loglik"] for m in separate]
    assert model.start_scores_ == scores and model.best_start_ == int(np.argmax(scores))
    for name in ("weights_", "means_", "covariances_"):
        assert np.array_equal(getattr(model, name), getattr(separate[model.best_start_], name)), name
    for start in sorted(set(range(5)) - {model.best_start_}):  # each named once, for the start that beat it
        assert caplog.text.count(f"n_init: start {start} (seed {10 + start}), left out for start ") == 1


@pytest.mark.parametrize("method", ["minibatch_em", "em"])
def test_a_fit_at_the_defaults_killed_and_rerun_resumes_with_the_seeds_it_drew(method, tmp_path, monkeypatch):
    """No random_state and n_init at its default (three starts on small data): the rerun reads the drawn seeds
    from the starts' checkpoints, resumes, and ends as the same run uninterrupted (which the seeds it drew,
    given as random_state, reproduce); a second rerun reads every start back."""
    settings = dict(method=method, **SETTINGS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _killed_in_start_1(monkeypatch, settings, tmp_path / "fit.ckpt")
        drawn = scalable_xd.fit.run.checkpoint.Checkpoint(tmp_path / "fit.start0.ckpt").seed
        resumed = XDGMM(**settings).fit(X, Xcov=S, checkpoint=tmp_path / "fit.ckpt")
        again = XDGMM(**settings).fit(X, Xcov=S, checkpoint=tmp_path / "fit.ckpt")
        uninterrupted = XDGMM(**settings, random_state=drawn).fit(X, Xcov=S)
    assert len(resumed.start_scores_) == 3
    assert resumed.start_scores_ == uninterrupted.start_scores_ == again.start_scores_
    for name in ("weights_", "means_", "covariances_"):
        assert np.array_equal(getattr(resumed, name), getattr(uninterrupted, name)), name


def test_with_validation_data_the_starts_are_judged_on_them():
    held_out = RNG.permutation(len(X))[:300]
    val = dict(X_val=X[held_out], Xcov_val=S[held_out])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = XDGMM(method="sgd", n_init=3, random_state=4, **SETTINGS).fit(X, Xcov=S, **val)
    scores = [m.history_[-1]["val_loglik"] for m in _separate("sgd", range(4, 7), **val)]
    assert model.start_scores_ == scores and model.best_start_ == int(np.argmax(scores))


def _killed_in_start_1(monkeypatch, settings: dict, checkpoint) -> None:
    """A fit of ``settings`` with ``checkpoint``, killed right after start 1's checkpoint of epoch 2."""
    save = scalable_xd.fit.run.checkpoint.save

    def save_then_crash(path, **state):
        save(path, **state)
        if ".start1." in str(path) and state["epoch"] == 2:
            raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(scalable_xd.fit.run.checkpoint, "save", save_then_crash)
        with pytest.raises(KeyboardInterrupt):
            XDGMM(**settings).fit(X, Xcov=S, checkpoint=checkpoint)


@pytest.mark.parametrize(
    ("method", "written"),
    [
        ("em", {"fit.start0.ckpt", "fit.start1.ckpt"}),  # one start after another: start 2 never began
        ("minibatch_em", {"fit.start0.ckpt", "fit.start1.ckpt", "fit.start2.ckpt"}),  # in lockstep
    ],
)
def test_a_run_killed_inside_a_start_resumes_it_and_reads_back_the_starts_done(method, written, tmp_path, monkeypatch):
    """Killed in start 1: batch EM's starts run one after another, so start 0 is done and start 2 never
    began; the minibatch starts run in lockstep (``fit.run.lockstep``), so the interrupt stops all three, each
    with its checkpoint. Either way the resumed run ends as the uninterrupted one, to the bit."""
    settings = dict(method=method, n_init=3, random_state=7, **SETTINGS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        uninterrupted = XDGMM(**settings).fit(X, Xcov=S)
        _killed_in_start_1(monkeypatch, settings, tmp_path / "fit.ckpt")
        assert {p.name for p in tmp_path.iterdir()} == written
        fitted = []
        fit_mixture = scalable_xd.fit.restarts.fit_mixture
        monkeypatch.setattr(scalable_xd.fit.restarts, "fit_mixture", lambda plan: fitted.append(1) or fit_mixture(plan))
        resumed = XDGMM(**settings).fit(X, Xcov=S, checkpoint=tmp_path / "fit.ckpt")
    assert resumed.start_scores_ == uninterrupted.start_scores_ and resumed.best_start_ == uninterrupted.best_start_
    for name in ("weights_", "means_", "covariances_"):
        assert np.array_equal(getattr(resumed, name), getattr(uninterrupted, name)), name
    assert len(fitted) == 3 and (tmp_path / "fit.start2.ckpt").exists()


def test_a_diverging_start_is_left_out_naming_it_and_the_scores_survive_save_and_load(tmp_path, monkeypatch):
    fit_mixture = scalable_xd.fit.restarts.fit_mixture

    def diverging_seed_11(plan):
        if plan.random_state == 11:
            raise FitDivergedError(3, 1, "has non-finite parameters", "a larger w")
        return fit_mixture(plan)

    monkeypatch.setattr(scalable_xd.fit.restarts, "fit_mixture", diverging_seed_11)
    with pytest.warns(
        UserWarning, match=r"n_init: 1 of 3 starts diverged and are left out: start 1 \(seed 11\)"
    ) as said:
        model = XDGMM(method="em", n_init=3, random_state=10, **SETTINGS).fit(X, Xcov=S)
    assert [w.filename for w in said if "diverged" in str(w.message)] == [__file__]  # the user's line
    assert model.start_scores_[1] is None and model.best_start_ in (0, 2)
    model.save(tmp_path / "model.npz")
    loaded = XDGMM.load(tmp_path / "model.npz")
    assert loaded.start_scores_ == model.start_scores_ and loaded.best_start_ == model.best_start_

    def diverging(plan):
        raise FitDivergedError(2, 0, "has non-finite parameters", "a larger w")

    monkeypatch.setattr(scalable_xd.fit.restarts, "fit_mixture", diverging)
    with pytest.warns(UserWarning, match=r"every start diverged; start 0 \(seed 10\)"):
        with pytest.raises(FitDivergedError, match="fit diverged at epoch 2"):  # every start: the last's error
            XDGMM(method="em", n_init=2, random_state=10, **SETTINGS).fit(X, Xcov=S)


@pytest.mark.parametrize("method", ["em", "minibatch_em"])
def test_only_the_kept_starts_warnings_reach_the_user_at_the_users_line(method, caplog):
    """Three starts of a short budget: none converges. One ConvergenceWarning, the kept start's, at this
    file's line; the two discarded starts' are logged, naming them."""
    with warnings.catch_warnings(record=True) as said, caplog.at_level("INFO", logger="scalable_xd.fit"):
        warnings.simplefilter("always")
        model = XDGMM(method=method, n_init=3, random_state=10, **{**SETTINGS, "epochs": 2}).fit(X, Xcov=S)
    assert not model.converged_
    assert [(w.category.__name__, w.filename) for w in said] == [("ConvergenceWarning", __file__)]
    left_out = sorted({0, 1, 2} - {model.best_start_})
    for start in left_out:
        assert f"n_init: start {start} (seed {10 + start}), left out for start {model.best_start_}: " in caplog.text


def test_partial_fit_refuses_restarts_and_warm_start_takes_one_start():
    with pytest.raises(ValueError, match="n_init=2: partial_fit carries one running state"):
        XDGMM(method="minibatch_em", n_init=2, **SETTINGS).partial_fit(X, Xcov=S)
    with pytest.raises(ValueError, match="n_init=2: warm_start continues the fitted model, one start"):
        XDGMM(method="em", n_init=2, warm_start=True, **SETTINGS).fit(X, Xcov=S)


def test_by_default_a_small_fit_takes_three_starts_and_says_so(caplog):
    """``n_init=None`` (the default): 3 starts where N x K is at most 1e6 (here 1,300 x 3) and the start is
    not given; the best of them is the fit of ``n_init=3``, and the log says what was chosen."""
    with caplog.at_level("INFO", logger="scalable_xd.fit"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        default = XDGMM(method="em", random_state=10, **SETTINGS).fit(X, Xcov=S)
    assert "n_init=None: 3 starts (N x K = 3,900 <= 1,000,000)" in caplog.text
    explicit = _separate_restarts(3)
    assert default.start_scores_ == explicit.start_scores_ and default.best_start_ == explicit.best_start_
    assert np.array_equal(default.means_, explicit.means_)


def _separate_restarts(n_init: int) -> XDGMM:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return XDGMM(method="em", n_init=n_init, random_state=10, **SETTINGS).fit(X, Xcov=S)


def test_by_default_a_large_fit_a_given_start_or_a_warm_start_takes_one_start(caplog, monkeypatch):
    with caplog.at_level("INFO", logger="scalable_xd.fit"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        means = XDGMM(method="em", random_state=10, means_init=X[:3], **SETTINGS).fit(X, Xcov=S)
        warm = XDGMM(method="em", random_state=10, warm_start=True, **SETTINGS).fit(X, Xcov=S)
        warm.fit(X, Xcov=S)  # the second call starts from the first's model
        monkeypatch.setattr(scalable_xd.fit.plan, "AUTO_STARTS_PAIRS", 3 * len(X) - 1)
        large = XDGMM(method="em", random_state=10, **SETTINGS).fit(X, Xcov=S)
    assert len(means.start_scores_) == len(warm.start_scores_) == len(large.start_scores_) == 1
    assert caplog.text.count("n_init=None: 1 start (start given)") == 2
    assert "n_init=None: 1 start (N x K = 3,900 > 3,899)" in caplog.text
    assert "3 starts" in caplog.text  # the warm start's first call, from k-means
