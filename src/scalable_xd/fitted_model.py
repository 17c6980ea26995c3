"""What a fitted XD model answers (``FittedXD``, ``XDGMM``'s base): log-likelihoods, responsibilities,
labels, each point's posterior, conditionals, samples, information criteria and the parameters' errors.

Every method reads the fitted state ``_set_fitted`` keeps: ``_mixture`` (float64 on the model's
device), ``_background``, ``_device``, ``_dtype``, ``backend_`` and ``settings_``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Self

import numpy as np
import torch
from sklearn.exceptions import NotFittedError

from ._torch import resolve_dtype
from .background import Background
from .conditioning import condition, floats, measured_features, measurement_noise
from .data.inputs import data_source
from .data.iterable import is_batch_iterable
from .data.source import DataSource
from .fit.run.scoring import EVAL_BATCH, scored_batches, total_loglik
from .jackknife import ParameterErrors, jackknife_errors
from .kernel.dispatch import fit_backend
from .mixture import Mixture
from .posterior import posterior_summary
from .settings import FitSettings, KMeansSettings, check_count, resolve_seed
from .sklearn_input import array_like, checked_input, refuse_noise_as_y

# The posterior's precision, whatever the fit's (see ``FittedXD.posterior``).
POSTERIOR_DTYPE = torch.float64


class FittedXD:
    """The methods of a fitted XD model; ``XDGMM`` fits it (see ``estimator``)."""

    _mixture: Mixture
    _background: Background | None
    _device: torch.device
    _dtype: torch.dtype
    n_features_in_: int
    get_params: Callable[..., dict]  # scikit-learn's ``BaseEstimator``'s

    def _set_fitted(
        self,
        mixture: Mixture,
        history: list,
        converged: bool,
        settings: FitSettings,
        kmeans: KMeansSettings,
        background: Background | None = None,
    ) -> None:
        """Keep a fit's result: the state every method here reads, and the fitted attributes
        (``weights_``, ``means_``, ``covariances_``, ``history_``, ...) as scikit-learn names them."""
        self._mixture = mixture
        self._background = background
        self.background_weight_ = 0.0 if background is None else background.weight
        self.settings_, self.kmeans_settings_ = settings, kmeans
        self._device, self._dtype = mixture.means.device, resolve_dtype(settings.dtype)
        self.backend_ = fit_backend(settings.backend, self._device)
        self.weights_ = mixture.weights.detach().cpu().numpy()
        self.means_ = mixture.means.detach().cpu().numpy()
        self.covariances_ = mixture.covariances.detach().cpu().numpy()
        self.history_ = history
        self.n_iter_ = history[-1]["epoch"] if history else 0
        self.converged_ = converged

    def _fitted(self) -> Mixture:
        """The fitted parameters in float64 on the model's device."""
        if not hasattr(self, "_mixture"):
            raise NotFittedError("this XDGMM is not fitted yet: call fit() or XDGMM.load() first")
        return self._mixture

    def _data_for_model(self, X, y, Xcov, R, method: str, sample_weight=None) -> DataSource:
        """Validated data that the fitted model can score: dimensions that match, values in range."""
        mixture = self._fitted()
        if Xcov is None and getattr(self, "_fitted_to_noise", False) and array_like(X):
            warnings.warn(
                f"{method}: X has no Xcov, so it is taken as noiseless, but the model was fitted to noisy data: "
                "pass the data's noise as Xcov (zeros where the values are exact, e.g. true values)",
                UserWarning,
                stacklevel=3,
            )
        X, sample_weight = checked_input(self, X, y, R, sample_weight, method, reset=False)
        data = data_source(X, Xcov, R, sample_weight, "X", self.settings_.missing)
        if data.model_dim != mixture.dim:
            raise ValueError(f"the model has dimension {mixture.dim} but the data (after R) has {data.model_dim}")
        data.check_range(self._dtype)
        return data

    def _scored_batches(self, X, y, Xcov, R, method: str):
        """Yield (start, log p(x) (B,), log alpha_j N_ij (B, K)) over the data in bounded-memory batches."""
        data = self._data_for_model(X, y, Xcov, R, method)
        return scored_batches(
            data, self._mixture, self._device, self._dtype, self.backend_, background=self._background
        )

    def score_samples(self, X, y=None, *, Xcov=None, R=None) -> np.ndarray:
        """log p(x_i) under the convolved model (and its background, where it has one) for each point, (N,),
        float64 as scikit-learn returns it (computed in the fit's ``dtype``)."""
        batches = self._scored_batches(X, y, Xcov, R, "score_samples")
        return torch.cat([ll.double().cpu() for _, ll, _, _ in batches]).numpy()

    def score(self, X, y=None, *, Xcov=None, R=None, sample_weight=None) -> float:
        """Mean log-likelihood per point (weighted by ``sample_weight`` where given)."""
        data = self._data_for_model(X, y, Xcov, R, "score", sample_weight)
        total = total_loglik(data, self._mixture, self._device, self._dtype, self.backend_, background=self._background)
        return total / data.total_weight

    def predict_proba(self, X, y=None, *, Xcov=None, R=None) -> np.ndarray:
        """Responsibilities r_ij: the probability that point i came from component j, shape (N, K). With a
        background, each row sums to the chance that the point is not the background's
        (1 - ``background_proba``). Float64, as scikit-learn returns them (from densities in the fit's
        ``dtype``)."""
        batches = self._scored_batches(X, y, Xcov, R, "predict_proba")
        return torch.cat([torch.exp((dens - ll[:, None]).double()).cpu() for _, ll, dens, _ in batches]).numpy()

    def background_proba(self, X, y=None, *, Xcov=None, R=None) -> np.ndarray:
        """The probability that each point is the background's (an outlier), shape (N,); zeros without one."""
        return _background_share(self.predict_proba(X, y, Xcov=Xcov, R=R))

    def predict(self, X, y=None, *, Xcov=None, R=None) -> np.ndarray:
        """The most probable component of each point, shape (N,); -1 where the background is more probable
        than any component."""
        refuse_noise_as_y(y, "predict")
        proba = self.predict_proba(X, Xcov=Xcov, R=R)
        labels = proba.argmax(axis=1)
        if self._background is not None:
            labels[_background_share(proba) > proba.max(axis=1)] = -1
        return labels

    def posterior(self, X, y=None, *, Xcov=None, R=None, q=None) -> tuple[np.ndarray, ...]:
        """Mean (N, D) and covariance (N, D, D) of each point's true value v_i given x_i ("denoised" data);
        with ``q``, probabilities in (0, 1), also the quantiles (N, D, len(q)) of each feature's marginal
        posterior, from the same pass: that marginal is a mixture of Gaussians (not the Gaussian of the
        moments), so its 16th and 84th percentiles give an interval that is right where the components
        disagree. Computed in float64 whatever the fit's ``dtype``: B = V - V T^-1 V subtracts nearly
        equal matrices, which float32 cannot resolve where the noise is 1e18 times narrower than V (Gaia's
        positions)."""
        probs = None
        if q is not None:
            probs = np.atleast_1d(floats(q, "q"))
            if probs.ndim != 1 or not np.all((probs > 0) & (probs < 1)):
                raise ValueError(f"q must be probabilities strictly between 0 and 1, got {q!r}")
        data = self._data_for_model(X, y, Xcov, R, "posterior")
        means, covs, quants = [], [], []
        for _, x, S, Rb, _, observed in data.scan(slice(0, len(data)), EVAL_BATCH, self._device, POSTERIOR_DTYPE):
            mean, cov, quant = posterior_summary(x, S, self._mixture, Rb, observed, probs, self._background)
            means.append(mean.cpu())
            covs.append(cov.cpu())
            if quant is not None:
                quants.append(quant.cpu())
        moments = (torch.cat(means).numpy(), torch.cat(covs).numpy())
        return moments if probs is None else (*moments, torch.cat(quants).numpy())

    def condition(self, X_given, Xcov_given=None) -> Self:
        """The mixture of the features left NaN in ``X_given`` (D,), given measurements of the others with
        noise ``Xcov_given`` (None: exact; variances or a covariance of the measured features), as a new
        fitted model of this class over those features (see ``conditioning``)."""
        mixture = self._fitted()
        measured, x_b = measured_features(X_given, mixture.dim)
        S_b = measurement_noise(Xcov_given, int(measured.sum()))
        conditioned = condition(mixture, measured, x_b, S_b)
        model = type(self)(**{**self.get_params(), "weights_init": None, "means_init": None, "covariances_init": None})
        model._set_fitted(conditioned, [], True, self.settings_, self.kmeans_settings_)
        model.n_features_in_ = conditioned.dim
        return model

    def sample(self, n_samples: int = 1, random_state: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Draw from the deconvolved density p(v): (samples (n_samples, D), each draw's component (n_samples,)),
        as scikit-learn's ``GaussianMixture.sample`` returns them; the background's share is drawn uniformly
        from its box and labelled -1. n_samples = 0 gives empty arrays."""
        mixture = self._fitted()
        check_count("n_samples", n_samples, minimum=0)
        seed = resolve_seed(random_state)
        if n_samples == 0:
            return np.empty((0, mixture.dim)), np.empty(0, dtype=np.int64)
        generator = torch.Generator()
        generator.manual_seed(seed)
        samples, labels = mixture.sample(int(n_samples), generator)
        if self._background is not None:
            outliers = torch.rand(int(n_samples), generator=generator) < self._background.weight
            samples[outliers] = self._background.sample(int(outliers.sum()), generator).to(samples.dtype)
            labels[outliers] = -1
        return samples.numpy(), labels.numpy()

    def _n_parameters(self) -> int:
        """The free parameters: the mixture's, and the background's weight where there is one."""
        return self._fitted().n_parameters() + (self._background is not None)

    def bic(self, X, y=None, *, Xcov=None, R=None) -> float:
        """Bayesian information criterion: -2 log L + n_parameters log N (lower is better)."""
        refuse_noise_as_y(y, "bic")
        log_l = self.score(X, Xcov=Xcov, R=R) * len(X)
        return -2.0 * log_l + self._n_parameters() * math.log(len(X))

    def aic(self, X, y=None, *, Xcov=None, R=None) -> float:
        """Akaike information criterion: -2 log L + 2 n_parameters (lower is better)."""
        refuse_noise_as_y(y, "aic")
        return -2.0 * self.score(X, Xcov=Xcov, R=R) * len(X) + 2 * self._n_parameters()

    def parameter_errors(
        self,
        X,
        y=None,
        *,
        Xcov=None,
        R=None,
        sample_weight=None,
        n_folds: int = 10,
        max_iter: int = 200,
        tol: float = 1e-8,
        random_state=None,
    ) -> ParameterErrors:
        """Standard errors of ``weights_``, ``means_`` and ``covariances_`` by the delete-a-group jackknife
        over the data the model was fitted to (arrays: X, Xcov, R and sample_weight as given to ``fit``).
        The fit is first converged on all the data (the errors' ``centre``); the rows are then split into
        ``n_folds`` groups at random (``random_state``), and each replicate leaves one group out and refits
        from the centre. Every refit is batch EM in float64, until an iteration gains less than ``tol`` nats
        a point or after ``max_iter`` iterations. Returns a ``jackknife.ParameterErrors`` holding the errors,
        the centre, the folds and the matched replicates. Costs ``n_folds + 1`` refits from a warm start."""
        self._fitted()
        X, sample_weight = checked_input(self, X, y, R, sample_weight, "parameter_errors", reset=False)
        if isinstance(X, DataSource) or is_batch_iterable(X):
            raise TypeError(
                "parameter_errors needs X, Xcov, R and sample_weight as arrays (a jackknife re-weights the rows), "
                f"not {type(X).__name__}"
            )
        return jackknife_errors(
            self,
            X,
            Xcov,
            R,
            sample_weight,
            n_folds=n_folds,
            max_iter=max_iter,
            tol=tol,
            random_state=random_state,
        )


def _background_share(proba: np.ndarray) -> np.ndarray:
    """Each point's background probability: what its components' probabilities (``predict_proba``) leave."""
    return np.clip(1.0 - proba.sum(axis=1), 0.0, 1.0)
