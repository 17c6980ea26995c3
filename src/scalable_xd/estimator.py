"""``XDGMM``: the user-facing estimator, in scikit-learn's style (fit / score / sample / save / load).

``fit`` validates the settings and the data and hands them to ``fit.driver.fit_mixture``, which runs the
fit; everything else uses a fitted model.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from sklearn.base import BaseEstimator
from sklearn.exceptions import NotFittedError

from ._torch import dtype_name, resolve_device, resolve_dtype
from .conditioning import condition, measured_features, measurement_noise
from .dataset import Dataset
from .fit.driver import Start, data_source, fit_mixture, settings_record
from .fit.loop import EVAL_BATCH, scored_batches, total_loglik
from .kernel.dispatch import fit_backend
from .mixture import Mixture
from .model_file import read_model, write_model
from .posterior import posterior_moments
from .settings import FitSettings, KMeansSettings, check_count, check_seed, resolve_seed

_FIT, _KMEANS = FitSettings(), KMeansSettings()


class XDGMM(BaseEstimator):
    """Extreme deconvolution: a Gaussian mixture for the true values behind noisy, projected data.

    Each observation is x_i = R_i v_i + noise with noise ~ N(0, S_i) known per point; the model is
    p(v) = sum_j alpha_j N(v | m_j, V_j), so p(x_i) = sum_j alpha_j N(x_i | R_i m_j, R_i V_j R_i^T + S_i).

    Parameters
    ----------
    n_components : number of mixture components K.
    method : ``"em"`` (Bovy et al. 2011 batch EM), ``"minibatch_em"`` (online EM), ``"sgd"`` (Adam), or
        stochastic EM (each star's component sampled from its responsibilities, then an EM update from
        those assignments): ``"stochastic_em"`` (batch: full passes) or ``"stochastic_minibatch_em"``.
    batch_size : points per minibatch for minibatch_em and sgd (batch EM sums over the whole data set,
        in chunks of at least 8,192 points).
    epochs : passes over the training data (for ``"em"``: the maximum number of iterations).
    step_size, step_schedule, step_decay, kappa : minibatch-EM step sizes. ``"cappe_moulines"`` uses
        lambda_t = (t0 + t)^-kappa over update count t, starting at ``step_size``: its
        sum, the number of batch-EM iterations online EM roughly amounts to, grows with the number of
        updates whatever N is. ``"step"`` is the paper's: ``step_size`` (the paper: 1e-2) multiplied by
        ``step_decay`` after ``decay_epoch`` epochs; its 20 epochs amount to 0.15 N / batch_size EM
        iterations, plenty at the paper's 1.6 million stars but 3 for 10,000 (an under-converged fit).
    lr, lr_decay : SGD (Adam) learning rate, multiplied by ``lr_decay`` after ``decay_epoch`` epochs.
    sgd_scaling : ``"none"`` is the paper's parametrisation in the features' own units, where a
        mean moves ~``lr`` per step whether its feature spans 0.3 mas or 300 degrees; ``"spread"`` measures
        the parameters in units of each feature's spread under the initial mixture. ``"spread"`` converges
        faster for wide features (gap to the truth closed on the 100k mock, K = 16: 38% against 29%), but a
        step is then the same size for a narrow component as for a wide one: on the 500k mock at K = 128 a
        narrow component became singular in float32 within the first epoch. Opt in with care.
    w : covariance regularisation: EM as Bovy et al. ((sum + wI)/(q + 1)); minibatch EM adds wI after each
        update; SGD adds the penalty sum_j w / tr(V_j) to the loss.
    tol : batch EM stops once an iteration improves the mean training log-likelihood by less than this
        (None: run every epoch).
    averaging : ``"polyak"`` reports the running mean of the parameters over all updates (minibatch methods;
        the updates themselves are unchanged), as Nguyen, Forbes & McLachlan's "P" variants.
    truncation, truncation_bound : minibatch EM restarts from the initial parameters whenever they leave the
        growing compact sets of Nguyen, Forbes & McLachlan (c1 = c2 = c3 = ``truncation_bound``, in the
        features' units; see ``fitters.MinibatchEM``); the restarts are counted in ``history_``.
    split_merge, split_merge_tries : Ueda et al.'s split-and-merge moves (merge two components, split a
        third), at most ``split_merge_tries`` of them; tried and accepted moves are counted in ``history_``.
        Batch EM as Bovy et al. (2011): after convergence, partial then full EM, a move kept only if the
        converged log-likelihood improves. Minibatch methods (the stochastic form; docs/split_merge.md): one
        move an epoch from running criteria, trained beside the incumbent for an epoch and kept only if it
        scores higher on the validation data (or a fixed sample of 20,000 training stars).
    covariance_update : ``"stable"`` (centred form) or ``"naive"`` (the paper's eq. 7) for minibatch EM.
    missing : ``"variance"`` (default, the paper's convention): missing entries are given as value 0 with
        variance 1e12 and scored like measured ones, adding log N(0 | 0, 1e12 + V_jj) each. ``"marginalise"``:
        an entry that is NaN in X or has variance >= 1e12 is missing, and each star is scored and updated on
        its observed entries only (the projection R_i that drops the others), exactly: the 1e12
        convention's limit, its score less the constant -log(2 pi 1e12) / 2 per missing entry, computed at the
        star's own smaller dimension and free of the 1e12 rounding (see ``kernel.dispatch``).
    kmeans_epochs, kmeans_batch_size : the minibatch k-means for the initial weights and means
        (covariances start at I).
    device : ``"auto"`` (CUDA when present), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
    dtype : ``"float32"`` or ``"float64"``: the precision of the per-pair statistics pass, the hot path.
        Parameters and their updates are always float64 (K x D x D numbers; see ``fitters``).
    compile : run the statistics pass through ``torch.compile`` on CUDA (R = I only; projected data keeps
        the LAPACK path): its ~370 small launches per chunk become a few Triton kernels, after a one-off
        compile cached on disk by PyTorch. On the CPU the numba kernel (``kernel.fused``) runs either way,
        ~2x faster than torch.compile's code; ``compile`` applies there only where numba is not installed
        (then it needs a C++ compiler). Same results to float tolerance.
    random_state : None, an int, a numpy ``RandomState`` or ``Generator``: seeds the k-means init and the
        batch order; the same int gives the same fit on CPU.
    weights_init, means_init, covariances_init : explicit initial parameters (any may be given alone).
    fix_weights, fix_means, fix_covariances : keep these parameters at their initial values, for every
        component (True) or those marked in a boolean array of length K, as Bovy et al.'s fixamp, fixmean
        and fixcovar; free weights share 1 - the fixed ones, and a fixed mean's covariance is the scatter
        about it (see ``updates.FixedParameters``). Every method honours them.
    verbose : 0 silent, 1 a line per epoch on the ``scalable_xd.fit`` logger (to stderr where logging is not
        configured), 2 also a tqdm progress bar per epoch.
    warm_start : when True, a second ``fit`` starts from the fitted parameters instead of k-means (as in
        scikit-learn; batch EM then continues exactly where it stopped).

    Defaults and constraints live in ``settings.FitSettings`` (and ``KMeansSettings``); they are checked
    when ``fit`` is called, as in scikit-learn, whose estimator contract ``XDGMM`` follows (``clone``,
    ``get_params``/``set_params``, ``GridSearchCV`` over ``n_components`` with ``score``).

    Divergence: a non-finite or non-positive-definite component raises ``FitDivergedError`` naming the epoch
    and component. Components whose responsibility sum underflows to zero are frozen with weight zero, as in
    Bovy's reference code.
    """

    def __init__(
        self,
        n_components: int = 1,
        method: str = _FIT.method,
        *,
        epochs: int = _FIT.epochs,
        batch_size: int = _FIT.batch_size,
        step_size: float = _FIT.step_size,
        step_schedule: str = _FIT.step_schedule,
        step_decay: float = _FIT.step_decay,
        kappa: float = _FIT.kappa,
        lr: float = _FIT.lr,
        lr_decay: float = _FIT.lr_decay,
        decay_epoch: int = _FIT.decay_epoch,
        sgd_scaling: str = _FIT.sgd_scaling,
        w: float = _FIT.w,
        tol: float | None = _FIT.tol,
        split_merge: bool = _FIT.split_merge,
        split_merge_tries: int = _FIT.split_merge_tries,
        averaging: str = _FIT.averaging,
        truncation: bool = _FIT.truncation,
        truncation_bound: float = _FIT.truncation_bound,
        covariance_update: str = _FIT.covariance_update,
        missing: str = _FIT.missing,
        device: str = _FIT.device,
        dtype: str = _FIT.dtype,
        compile: bool = _FIT.compile,
        verbose: int = _FIT.verbose,
        kmeans_epochs: int = _KMEANS.epochs,
        kmeans_batch_size: int = _KMEANS.batch_size,
        random_state=None,
        warm_start: bool = False,
        weights_init=None,
        means_init=None,
        covariances_init=None,
        fix_weights=False,
        fix_means=False,
        fix_covariances=False,
    ):
        self.n_components = n_components
        self.method = method
        self.epochs = epochs
        self.batch_size = batch_size
        self.step_size = step_size
        self.step_schedule = step_schedule
        self.step_decay = step_decay
        self.kappa = kappa
        self.lr = lr
        self.lr_decay = lr_decay
        self.decay_epoch = decay_epoch
        self.sgd_scaling = sgd_scaling
        self.w = w
        self.tol = tol
        self.split_merge = split_merge
        self.split_merge_tries = split_merge_tries
        self.averaging = averaging
        self.truncation = truncation
        self.truncation_bound = truncation_bound
        self.covariance_update = covariance_update
        self.missing = missing
        self.device = device
        self.dtype = dtype
        self.compile = compile
        self.verbose = verbose
        self.kmeans_epochs = kmeans_epochs
        self.kmeans_batch_size = kmeans_batch_size
        self.random_state = random_state
        self.warm_start = warm_start
        self.weights_init = weights_init
        self.means_init = means_init
        self.covariances_init = covariances_init
        self.fix_weights = fix_weights
        self.fix_means = fix_means
        self.fix_covariances = fix_covariances

    # ------------------------------------------------------------------ configuration

    def _validated(self) -> tuple[FitSettings, KMeansSettings]:
        """The settings, checked once per fit (as scikit-learn estimators do); raises ValueError naming the
        parameter."""
        params = self.get_params()
        settings = FitSettings(**{name: params[name] for name in FitSettings.defaults()})
        kmeans = KMeansSettings(epochs=self.kmeans_epochs, batch_size=self.kmeans_batch_size)
        check_count("n_components", self.n_components)
        if not isinstance(self.random_state, (np.random.RandomState, np.random.Generator, type(None))):
            check_seed("random_state", self.random_state)
        if not isinstance(self.warm_start, bool):
            raise ValueError(f"warm_start must be True or False, got {self.warm_start!r}")
        self._fixed_masks()
        return settings, kmeans

    def describe(self) -> dict:
        """The settings of the fitted model as JSON-friendly values (saved with it and in the metrics)."""
        seed = self.random_state if isinstance(self.random_state, (int, np.integer)) else None
        return {**settings_record(self.n_components, self.settings_, self.kmeans_settings_), "random_state": seed}

    # ------------------------------------------------------------------ fitting

    def fit(
        self,
        X,
        Xcov=None,
        *,
        R=None,
        sample_weight=None,
        X_val=None,
        Xcov_val=None,
        R_val=None,
        checkpoint=None,
        checkpoint_every: int = 0,
    ) -> XDGMM:
        """Fit to X (N, d) with noise covariances Xcov: (N, d, d), diagonal variances (N, d), a
        ``CompactCovariance``, or None for noiseless data. X (and X_val) may instead be a
        ``stream.ParquetSource``, data read from disk a window at a time (without Xcov, R or weights; k-means
        then sees a sample of 1,000,000 stars). ``R`` (N, d, D) projects the model space onto the
        data (identity when None). ``sample_weight`` (N,): non-negative weights, a point of weight 2 counting
        as two copies (Bovy's ``weight``; the k-means initial means ignore them). Validation data, if given,
        is scored after every epoch. ``checkpoint``: a file written atomically after each epoch (and every
        ``checkpoint_every`` batches inside one, for epochs too long to lose: not with split_merge); if it
        exists, the fit resumes from it where it was written.

        Data-parallel: called on every process of an initialised ``torch.distributed`` group (each with the
        same data and settings), every global batch is split across the processes and their sums are
        reduced, so all of them end with the same model; only rank 0 writes the checkpoint (see
        ``fit.parallel``; ``torchrun ... -m scalable_xd fit`` sets this up).
        """
        settings, kmeans = self._validated()
        check_count("checkpoint_every", checkpoint_every, minimum=0)
        if checkpoint_every and settings.split_merge:
            raise ValueError(
                "checkpoint_every: split_merge fits checkpoint at epochs' ends only (a move's trial spans an epoch)"
            )
        train, val = self._training_data(X, Xcov, R, X_val, Xcov_val, R_val, settings, sample_weight)
        warm = self._mixture if self.warm_start and hasattr(self, "_mixture") else None
        init = (self.weights_init, self.means_init, self.covariances_init)
        start = Start(self.n_components, self._fixed_masks(), *init, warm=warm)
        fitted = fit_mixture(train, val, settings, kmeans, self.random_state, start, checkpoint, checkpoint_every)
        self._set_fitted(fitted.mixture, fitted.history, fitted.converged, settings, kmeans)
        self.n_features_in_ = train.obs_dim
        return self

    def _fixed_masks(self) -> dict[str, np.ndarray]:
        """``fix_weights``, ``fix_means`` and ``fix_covariances`` as boolean arrays of length K."""
        masks = {}
        for name in ("fix_weights", "fix_means", "fix_covariances"):
            value = getattr(self, name)
            if isinstance(value, (bool, np.bool_)):
                masks[name] = np.full(self.n_components, bool(value))
                continue
            mask = np.asarray(value)
            if mask.dtype != bool or mask.shape != (self.n_components,):
                raise ValueError(
                    f"{name} must be True, False or a boolean array of length n_components "
                    f"({self.n_components}), got {value!r}"
                )
            masks[name] = mask
        return masks

    def _training_data(self, X, Xcov, R, X_val, Xcov_val, R_val, settings: FitSettings, sample_weight=None):
        """The validated training and validation sets (in memory, or streamed sources)."""
        dtype = resolve_dtype(settings.dtype)
        train = data_source(X, Xcov, R, sample_weight, "X", settings.missing)
        train.check_range(dtype)
        if self.n_components > len(train):
            raise ValueError(f"n_components={self.n_components} is larger than the number of points ({len(train)})")
        val = None
        if X_val is not None:
            val = data_source(X_val, Xcov_val, R_val, None, "X_val", settings.missing)
            if val.obs_dim != train.obs_dim or val.model_dim != train.model_dim:
                raise ValueError("X_val (and R_val) must have the same dimensions as X (and R)")
            val.check_range(dtype, "X_val")
        return train, val

    def _set_fitted(
        self, mixture: Mixture, history: list, converged: bool, settings: FitSettings, kmeans: KMeansSettings
    ) -> None:
        self._mixture = mixture
        self.settings_, self.kmeans_settings_ = settings, kmeans
        self._device, self._dtype = mixture.means.device, resolve_dtype(settings.dtype)
        self._backend = fit_backend(settings.compile, self._device)
        self.weights_ = mixture.weights.detach().cpu().numpy()
        self.means_ = mixture.means.detach().cpu().numpy()
        self.covariances_ = mixture.covariances.detach().cpu().numpy()
        self.history_ = history
        self.n_iter_ = history[-1]["epoch"] if history else 0
        self.converged_ = converged

    # ------------------------------------------------------------------ using a fitted model

    def _fitted(self) -> Mixture:
        """The fitted parameters in float64 on the model's device."""
        if not hasattr(self, "_mixture"):
            raise NotFittedError("this XDGMM is not fitted yet: call fit() or XDGMM.load() first")
        return self._mixture

    def _data_for_model(self, X, Xcov, R, sample_weight=None) -> Dataset:
        """Validated data that the fitted model can score: dimensions that match, values in range."""
        mixture = self._fitted()
        data = data_source(X, Xcov, R, sample_weight, "X", self.settings_.missing)
        if data.model_dim != mixture.dim:
            raise ValueError(f"the model has dimension {mixture.dim} but the data (after R) has {data.model_dim}")
        data.check_range(self._dtype)
        return data

    def _scored_batches(self, X, Xcov, R):
        """Yield (start, log p(x) (B,), log alpha_j N_ij (B, K)) over the data in bounded-memory batches."""
        data = self._data_for_model(X, Xcov, R)
        return scored_batches(data, self._mixture, self._device, self._dtype, self._backend)

    def score_samples(self, X, Xcov=None, R=None) -> np.ndarray:
        """log p(x_i) under the convolved model for each point, shape (N,)."""
        return torch.cat([ll.cpu() for _, ll, _, _ in self._scored_batches(X, Xcov, R)]).numpy()

    def score(self, X, Xcov=None, R=None, sample_weight=None) -> float:
        """Mean log-likelihood per point (weighted by ``sample_weight`` where given)."""
        data = self._data_for_model(X, Xcov, R, sample_weight)
        return total_loglik(data, self._mixture, self._device, self._dtype, self._backend) / data.total_weight

    def predict_proba(self, X, Xcov=None, R=None) -> np.ndarray:
        """Responsibilities r_ij: the probability that point i came from component j, shape (N, K)."""
        parts = [torch.exp(dens - ll[:, None]).cpu() for _, ll, dens, _ in self._scored_batches(X, Xcov, R)]
        return torch.cat(parts).numpy()

    def predict(self, X, Xcov=None, R=None) -> np.ndarray:
        """The most probable component of each point, shape (N,)."""
        return self.predict_proba(X, Xcov, R).argmax(axis=1)

    def posterior(self, X, Xcov=None, R=None) -> tuple[np.ndarray, np.ndarray]:
        """Mean (N, D) and covariance (N, D, D) of each point's true value v_i given x_i ("denoised" data)."""
        data = self._data_for_model(X, Xcov, R)
        mixture = self._mixture
        means, covs = [], []
        for _, x, S, Rb, _, observed in data.scan(slice(0, len(data)), EVAL_BATCH, self._device, self._dtype):
            mean, cov = posterior_moments(x, S, mixture, Rb, observed)
            means.append(mean.cpu())
            covs.append(cov.cpu())
        return torch.cat(means).numpy(), torch.cat(covs).numpy()

    def condition(self, X_given, Xcov_given=None) -> XDGMM:
        """The mixture of the features left NaN in ``X_given`` (D,), given measurements of the others with
        noise ``Xcov_given`` (None: exact; variances or a covariance of the measured features), as a new
        fitted ``XDGMM`` over those features (see ``conditioning``)."""
        mixture = self._fitted()
        measured, x_b = measured_features(X_given, mixture.dim)
        S_b = measurement_noise(Xcov_given, int(measured.sum()))
        conditioned = condition(mixture, measured, x_b, S_b)
        model = type(self)(**{**self.get_params(), "weights_init": None, "means_init": None, "covariances_init": None})
        model._set_fitted(conditioned, [], True, self.settings_, self.kmeans_settings_)
        model.n_features_in_ = conditioned.dim
        return model

    def sample(self, n_samples: int = 1, random_state: int | None = None) -> np.ndarray:
        """Draw from the deconvolved density p(v), shape (n_samples, D); n_samples = 0 gives an empty array."""
        mixture = self._fitted()
        check_count("n_samples", n_samples, minimum=0)
        seed = resolve_seed(random_state)
        if n_samples == 0:
            return np.empty((0, mixture.dim))
        generator = torch.Generator()
        generator.manual_seed(seed)
        samples, _ = mixture.sample(int(n_samples), generator)
        return samples.numpy()

    def bic(self, X, Xcov=None, R=None) -> float:
        """Bayesian information criterion: -2 log L + n_parameters log N (lower is better)."""
        return -2.0 * self.score(X, Xcov, R) * len(X) + self._fitted().n_parameters() * math.log(len(X))

    def aic(self, X, Xcov=None, R=None) -> float:
        """Akaike information criterion: -2 log L + 2 n_parameters (lower is better)."""
        return -2.0 * self.score(X, Xcov, R) * len(X) + 2 * self._fitted().n_parameters()

    # ------------------------------------------------------------------ persistence

    def save(self, path) -> None:
        """Write parameters, settings and history to one ``.npz`` file, atomically (see ``model_file``)."""
        write_model(
            path,
            self._fitted(),
            {
                "params": self.describe(),
                "history": self.history_,
                "converged": self.converged_,
                "dtype": dtype_name(self._dtype),
                "n_features_in": getattr(self, "n_features_in_", None),
            },
        )

    @classmethod
    def load(cls, path, device: str | None = None) -> XDGMM:
        """Read a model written by ``save``; ``device`` overrides the saved one (e.g. "cpu" for a GPU fit).

        The file is read without unpickling, and its parameters and settings are checked as strictly as a
        fit's: a damaged, foreign or invalid file raises ValueError naming it."""
        mixture, meta = read_model(path)
        params = dict(meta.get("params", {}))
        if device is not None:
            params["device"] = device
        elif params.get("device", "cpu") != "cpu" and not torch.cuda.is_available():
            params["device"] = "cpu"
        try:
            model = cls(**params)
            settings, kmeans = model._validated()
            device = resolve_device(settings.device)
        except (TypeError, ValueError) as err:
            raise ValueError(f"model {path} has invalid settings: {err}") from None
        if model.n_components != mixture.n_components:
            raise ValueError(
                f"model {path}: n_components is {model.n_components} but it holds {mixture.n_components} components"
            )
        model._set_fitted(mixture.to(device), meta.get("history", []), meta.get("converged", False), settings, kmeans)
        model.n_features_in_ = meta.get("n_features_in") or mixture.dim  # files before it was saved: R = I
        return model
