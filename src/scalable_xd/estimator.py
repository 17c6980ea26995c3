"""``XDGMM``: the user-facing estimator, in scikit-learn's style (fit / score / sample / save / load)."""

from __future__ import annotations

import json
import math
import zipfile
from pathlib import Path

import numpy as np
import torch

from ._torch import dtype_name, resolve_device, resolve_dtype
from .dataset import Dataset
from .fit.fitters import SGD, BatchEM, MinibatchEM
from .io import atomic_path
from .fit.kmeans import minibatch_kmeans, weights_from_counts
from .mixture import Mixture
from .posterior import posterior_moments
from .fit import checkpoint as checkpoints
from .fit.loop import EVAL_BATCH, LoopConfig, run, scored_batches

METHODS = ("em", "minibatch_em", "sgd")
SCHEDULES = ("step", "cappe_moulines")
COVARIANCE_UPDATES = ("stable", "naive")
SGD_SCALINGS = ("spread", "none")
FORMAT_VERSION = 1


def _placeholder_mixture(k: int, dim: int, device) -> Mixture:
    """Valid parameters of the right shape, to be overwritten by a checkpoint's state."""
    eye = torch.eye(dim, dtype=torch.float64, device=device)
    return Mixture(torch.full((k,), 1.0 / k, dtype=torch.float64, device=device),
                   torch.zeros(k, dim, dtype=torch.float64, device=device), eye.expand(k, dim, dim).clone())  # fmt: skip


def _check_seed(name: str, value) -> None:
    """Seeds are None or integers in [0, 2**63): what torch's and numpy's generators both accept."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < 2**63:
        raise ValueError(f"{name} must be None or an integer in [0, 2**63), got {value!r}")


class XDGMM:
    """Extreme deconvolution: a Gaussian mixture for the true values behind noisy, projected data.

    Each observation is x_i = R_i v_i + noise with noise ~ N(0, S_i) known per point; the model is
    p(v) = sum_j alpha_j N(v | m_j, V_j), so p(x_i) = sum_j alpha_j N(x_i | R_i m_j, R_i V_j R_i^T + S_i).

    Parameters
    ----------
    n_components : number of mixture components K.
    method : ``"em"`` (Bovy et al. 2011 batch EM), ``"minibatch_em"`` (online EM) or ``"sgd"`` (Adam).
    batch_size : points per minibatch for minibatch_em, sgd and the k-means init (batch EM sums over the
        whole data set, in chunks of at least 8,192 points).
    epochs : passes over the training data (for ``"em"``: the maximum number of iterations).
    step_size, step_schedule, step_decay, kappa : minibatch-EM step sizes. ``"cappe_moulines"`` (default)
        uses lambda_t = (t0 + t)^-kappa over update count t, starting at ``step_size`` (default 0.1): its
        sum, the number of batch-EM iterations online EM roughly amounts to, grows with the number of
        updates whatever N is. ``"step"`` is the paper's: ``step_size`` (the paper: 1e-2) multiplied by
        ``step_decay`` after ``decay_epoch`` epochs; its 20 epochs amount to 0.15 N / batch_size EM
        iterations, plenty at the paper's 1.6 million stars but 3 for 10,000 (an under-converged fit).
    lr, lr_decay : SGD (Adam) learning rate, multiplied by ``lr_decay`` after ``decay_epoch`` epochs.
    sgd_scaling : ``"none"`` (default) is the paper's parametrisation in the features' own units, where a
        mean moves ~``lr`` per step whether its feature spans 0.3 mas or 300 degrees; ``"spread"`` measures
        the parameters in units of each feature's spread under the initial mixture. ``"spread"`` converges
        faster for wide features (gap to the truth closed on the 100k mock, K = 16: 38% against 29%), but a
        step is then the same size for a narrow component as for a wide one: on the 500k mock at K = 128 a
        narrow component became singular in float32 within the first epoch. Opt in with care.
    w : covariance regularisation: EM as Bovy et al. ((sum + wI)/(q + 1)); minibatch EM adds wI after each
        update; SGD adds the penalty sum_j w / tr(V_j) to the loss.
    tol : batch EM stops once an iteration improves the mean training log-likelihood by less than this.
    covariance_update : ``"stable"`` (centred form, default) or ``"naive"`` (the paper's eq. 7) for minibatch EM.
    kmeans_epochs : epochs of minibatch k-means for the initial weights and means (covariances start at I).
    device : ``"auto"`` (CUDA when present), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
    dtype : ``"float32"`` or ``"float64"``: the precision of the per-pair statistics pass, the hot path.
        Parameters and their updates are always float64 (K x D x D numbers; see ``fitters``).
    compile : run the statistics pass through ``torch.compile`` (R = I only; projected data keeps the LAPACK
        path). Same results to float tolerance; 2-3.5x faster on CPU after a one-off compile of ~40 s per
        dtype (cached on disk by PyTorch); on CUDA its ~370 small launches per chunk become a few Triton
        kernels. Needs a C++ compiler on CPU, Triton on CUDA.
    random_state : seeds the k-means init and the batch order; the same value gives the same fit on CPU.
    weights_init, means_init, covariances_init : explicit initial parameters (any may be given alone).
    verbose : 0 silent, 1 a line per epoch on stderr, 2 also a progress bar per epoch (off when not a TTY).

    Divergence: a non-finite or non-positive-definite component raises ``FitDivergedError`` naming the epoch
    and component. Components whose responsibility sum underflows to zero are frozen with weight zero, as in
    Bovy's reference code.
    """

    def __init__(
        self,
        n_components: int = 1,
        method: str = "em",
        *,
        batch_size: int = 500,
        epochs: int = 20,
        step_size: float = 0.1,
        step_schedule: str = "cappe_moulines",
        step_decay: float = 0.5,
        kappa: float = 0.6,
        lr: float = 1e-2,
        lr_decay: float = 0.1,
        sgd_scaling: str = "none",
        decay_epoch: int = 10,
        w: float = 1e-3,
        tol: float = 1e-6,
        covariance_update: str = "stable",
        kmeans_epochs: int = 10,
        device: str = "auto",
        dtype: str = "float32",
        compile: bool = False,
        random_state: int | None = None,
        weights_init=None,
        means_init=None,
        covariances_init=None,
        verbose: int = 0,
    ):
        self.n_components = n_components
        self.method = method
        self.batch_size = batch_size
        self.epochs = epochs
        self.step_size = step_size
        self.step_schedule = step_schedule
        self.step_decay = step_decay
        self.kappa = kappa
        self.lr = lr
        self.lr_decay = lr_decay
        self.sgd_scaling = sgd_scaling
        self.decay_epoch = decay_epoch
        self.w = w
        self.tol = tol
        self.covariance_update = covariance_update
        self.kmeans_epochs = kmeans_epochs
        self.device = device
        self.dtype = dtype
        self.compile = compile
        self.random_state = random_state
        self.weights_init = weights_init
        self.means_init = means_init
        self.covariances_init = covariances_init
        self.verbose = verbose
        self._check_params()

    # ------------------------------------------------------------------ configuration

    def _check_params(self) -> None:
        def positive_int(name):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        def in_range(name, low, high, low_open=False):
            value = getattr(self, name)
            ok = isinstance(value, (int, float)) and math.isfinite(value)
            ok = ok and (value > low if low_open else value >= low) and value <= high
            if not ok:
                bracket = "(" if low_open else "["
                raise ValueError(f"{name} must be in {bracket}{low}, {high}], got {value!r}")

        positive_int("n_components")
        positive_int("batch_size")
        positive_int("epochs")
        positive_int("kmeans_epochs")
        if not isinstance(self.decay_epoch, (int, np.integer)) or self.decay_epoch < 0:
            raise ValueError(f"decay_epoch must be a non-negative integer, got {self.decay_epoch!r}")
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}: choose one of {', '.join(METHODS)}")
        if self.step_schedule not in SCHEDULES:
            raise ValueError(f"unknown step_schedule {self.step_schedule!r}: choose one of {', '.join(SCHEDULES)}")
        if self.covariance_update not in COVARIANCE_UPDATES:
            raise ValueError(
                f"unknown covariance_update {self.covariance_update!r}: choose one of {', '.join(COVARIANCE_UPDATES)}"
            )
        if self.sgd_scaling not in SGD_SCALINGS:
            raise ValueError(f"unknown sgd_scaling {self.sgd_scaling!r}: choose one of {', '.join(SGD_SCALINGS)}")
        in_range("step_size", 0, 1, low_open=True)
        in_range("step_decay", 0, 1, low_open=True)
        in_range("kappa", 0.5, 1, low_open=True)
        in_range("lr", 0, math.inf, low_open=True)
        in_range("lr_decay", 0, 1, low_open=True)
        in_range("w", 0, math.inf)
        if self.tol is not None:
            in_range("tol", 0, math.inf)
        if not isinstance(self.compile, bool):
            raise ValueError(f"compile must be True or False, got {self.compile!r}")
        _check_seed("random_state", self.random_state)
        if not isinstance(self.verbose, (int, np.integer)) or not 0 <= self.verbose <= 2:
            raise ValueError(f"verbose must be 0, 1 or 2, got {self.verbose!r}")
        self._device = resolve_device(self.device)
        self._dtype = resolve_dtype(self.dtype)

    @property
    def _backend(self) -> str:
        """The kernel backend (see ``kernel``); "auto" picks the LAPACK path for projected data."""
        return "compiled" if self.compile else "auto"

    def get_params(self) -> dict:
        """The constructor arguments (initial-parameter arrays excluded), as JSON-friendly values."""
        keys = [
            "n_components", "method", "batch_size", "epochs", "step_size", "step_schedule", "step_decay", "kappa",
            "lr", "lr_decay", "sgd_scaling", "decay_epoch", "w", "tol", "covariance_update", "kmeans_epochs", "device", "dtype",
            "compile", "random_state", "verbose",
        ]  # fmt: skip
        return {key: getattr(self, key) for key in keys}

    # ------------------------------------------------------------------ fitting

    def _initial_mixture(self, data: Dataset, seed: int) -> Mixture:
        k, dim = self.n_components, data.model_dim
        f64 = torch.float64
        means = None if self.means_init is None else torch.as_tensor(np.asarray(self.means_init), dtype=f64)
        weights = None if self.weights_init is None else torch.as_tensor(np.asarray(self.weights_init), dtype=f64)
        if means is None:
            if data.R is not None and data.obs_dim != dim:
                raise ValueError("means_init is required when the projection R changes the dimension")
            centres, counts = minibatch_kmeans(
                data.X.to(self._dtype), k, epochs=self.kmeans_epochs, batch_size=self.batch_size,
                seed=seed, device=self._device,
            )  # fmt: skip
            means = centres.to("cpu", f64)
            if weights is None:
                weights = weights_from_counts(counts)
        if weights is None:
            weights = torch.ones(k, dtype=f64)
        if self.covariances_init is None:
            covariances = torch.eye(dim, dtype=f64).expand(k, dim, dim).clone()
        else:
            covariances = torch.as_tensor(np.asarray(self.covariances_init), dtype=f64)
        for name, value, shape in (
            ("weights_init", weights, (k,)),
            ("means_init", means, (k, dim)),
            ("covariances_init", covariances, (k, dim, dim)),
        ):
            if tuple(value.shape) != shape:
                raise ValueError(f"{name} must have shape {shape}, got {tuple(value.shape)}")
            if not torch.isfinite(value).all():
                raise ValueError(f"{name} contains NaN or inf")
        if (weights <= 0).any():
            raise ValueError("weights_init must be positive")
        mixture = Mixture(weights / weights.sum(), means, covariances)
        problem = mixture.first_invalid_component()
        if problem is not None:
            raise ValueError(f"covariances_init component {problem[0]} is not symmetric positive definite")
        return mixture.to(self._device, torch.float64)  # parameters live in float64 (see ``fitters``)

    def _make_fitter(self, mixture: Mixture):
        if self.method == "em":
            return BatchEM(mixture, w=self.w)
        if self.method == "minibatch_em":
            return MinibatchEM(
                mixture, w=self.w, step_size=self.step_size, schedule=self.step_schedule,
                step_decay=self.step_decay, decay_epoch=self.decay_epoch, kappa=self.kappa,
                covariance_update=self.covariance_update,
            )  # fmt: skip
        return SGD(mixture, w=self.w, lr=self.lr, lr_decay=self.lr_decay, decay_epoch=self.decay_epoch,
                   scaling=self.sgd_scaling)  # fmt: skip

    def fit(self, X, Xcov=None, *, R=None, X_val=None, Xcov_val=None, R_val=None, checkpoint=None) -> XDGMM:
        """Fit to X (N, d) with noise covariances Xcov: (N, d, d), diagonal variances (N, d), a
        ``CompactCovariance``, or None for noiseless data. ``R`` (N, d, D) projects the model space onto the
        data (identity when None). Validation data, if given, is scored after every epoch. ``checkpoint``:
        a file written atomically after each epoch; if it exists, the fit resumes from it.
        """
        self._check_params()
        train = Dataset(X, Xcov, R)
        train.check_range(self._dtype)
        if self.n_components > len(train):
            raise ValueError(f"n_components={self.n_components} is larger than the number of points ({len(train)})")
        val = None
        if X_val is not None:
            val = Dataset(X_val, Xcov_val, R_val, name="X_val")
            val.check_range(self._dtype, "X_val")
            if val.obs_dim != train.obs_dim or val.model_dim != train.model_dim:
                raise ValueError("X_val (and R_val) must have the same dimensions as X (and R)")
        checkpoint = None if checkpoint is None else Path(checkpoint)
        resume = checkpoints.load(checkpoint, self._device) if checkpoint is not None and checkpoint.exists() else None
        if self.random_state is not None:
            seed = self.random_state
        elif resume is not None:
            seed = checkpoints.saved_seed(resume)
        else:
            seed = int(np.random.SeedSequence().entropy % 2**62)
        fingerprint = {**self.get_params(), "verbose": None, "compile": None, "n": len(train), "d": train.obs_dim,
                       "D": train.model_dim, "seed": seed}  # fmt: skip
        if checkpoint is not None:  # bind the checkpoint to the data (costs one pass over X)
            fingerprint["data"] = checkpoints.data_digest(train)
            fingerprint["val_data"] = None if val is None else checkpoints.data_digest(val)
            fingerprint["init"] = checkpoints.array_digest(self.weights_init, self.means_init, self.covariances_init)
        if resume is not None:
            checkpoints.check_matches(resume, fingerprint, checkpoint)
            # the checkpoint holds the state; skip the (possibly long) k-means init
            mixture = _placeholder_mixture(self.n_components, train.model_dim, self._device)
        else:
            mixture = self._initial_mixture(train, seed)
        fitter = self._make_fitter(mixture)
        config = LoopConfig(
            epochs=self.epochs,
            batch_size=self.batch_size if self.method != "em" else max(self.batch_size, EVAL_BATCH),
            shuffle=self.method != "em",
            seed=seed,
            device=self._device,
            dtype=self._dtype,
            backend=self._backend,
            w=self.w,
            tol=self.tol if self.method == "em" else None,
            verbose=self.verbose,
            checkpoint=checkpoint,
            fingerprint=fingerprint,
        )
        history, converged = run(fitter, train, val, config, resume)
        self._set_fitted(fitter.mixture, history, converged)
        return self

    def _set_fitted(self, mixture: Mixture, history: list, converged: bool) -> None:
        self._mixture = mixture
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
            raise RuntimeError("this XDGMM is not fitted yet: call fit() or XDGMM.load() first")
        return self._mixture

    def _data_for_model(self, X, Xcov, R) -> Dataset:
        """Validated data that the fitted model can score: dimensions that match, values in range."""
        mixture = self._fitted()
        data = Dataset(X, Xcov, R)
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
        return torch.cat([ll.cpu() for _, ll, _ in self._scored_batches(X, Xcov, R)]).numpy()

    def score(self, X, Xcov=None, R=None) -> float:
        """Mean log-likelihood per point."""
        total = sum(float(ll.sum(dtype=torch.float64)) for _, ll, _ in self._scored_batches(X, Xcov, R))
        return total / len(X)

    def predict_proba(self, X, Xcov=None, R=None) -> np.ndarray:
        """Responsibilities r_ij: the probability that point i came from component j, shape (N, K)."""
        parts = [torch.exp(dens - ll[:, None]).cpu() for _, ll, dens in self._scored_batches(X, Xcov, R)]
        return torch.cat(parts).numpy()

    def predict(self, X, Xcov=None, R=None) -> np.ndarray:
        """The most probable component of each point, shape (N,)."""
        return self.predict_proba(X, Xcov, R).argmax(axis=1)

    def posterior(self, X, Xcov=None, R=None) -> tuple[np.ndarray, np.ndarray]:
        """Mean (N, D) and covariance (N, D, D) of each point's true value v_i given x_i ("denoised" data)."""
        data = self._data_for_model(X, Xcov, R)
        mixture = self._mixture
        means, covs = [], []
        for start in range(0, len(data), EVAL_BATCH):
            x, S, Rb = data.batch(slice(start, start + EVAL_BATCH), self._device, self._dtype)
            mean, cov = posterior_moments(x, S, mixture, Rb)
            means.append(mean.cpu())
            covs.append(cov.cpu())
        return torch.cat(means).numpy(), torch.cat(covs).numpy()

    def sample(self, n_samples: int = 1, random_state: int | None = None) -> np.ndarray:
        """Draw from the deconvolved density p(v), shape (n_samples, D); n_samples = 0 gives an empty array."""
        mixture = self._fitted()
        if isinstance(n_samples, bool) or not isinstance(n_samples, (int, np.integer)) or n_samples < 0:
            raise ValueError(f"n_samples must be a non-negative integer, got {n_samples!r}")
        _check_seed("random_state", random_state)
        if n_samples == 0:
            return np.empty((0, mixture.dim))
        generator = torch.Generator()
        generator.manual_seed(random_state if random_state is not None else int(np.random.SeedSequence().entropy % 2**62))
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
        """Write parameters, settings and history to one ``.npz`` file, atomically."""
        self._fitted()
        meta = {
            "format_version": FORMAT_VERSION,
            "params": self.get_params(),
            "history": self.history_,
            "converged": self.converged_,
            "dtype": dtype_name(self._dtype),
        }
        with atomic_path(path, suffix=".npz") as tmp:
            np.savez(
                tmp, weights=self.weights_, means=self.means_, covariances=self.covariances_,
                meta=np.array(json.dumps(meta)),
            )  # fmt: skip

    @classmethod
    def load(cls, path, device: str | None = None) -> XDGMM:
        """Read a model written by ``save``; ``device`` overrides the saved one (e.g. "cpu" for a GPU fit).

        The file is read without unpickling, and its parameters are checked as strictly as a fit's: a
        damaged or foreign file raises ValueError naming it."""
        not_ours = f"{path} is not a model written by XDGMM.save"
        try:
            with np.load(path, allow_pickle=False) as archive:
                missing = [key for key in ("weights", "means", "covariances", "meta") if key not in archive.files]
                if missing:
                    raise ValueError(f"{not_ours} (it lacks {', '.join(missing)})")
                meta = json.loads(str(archive["meta"]))
                arrays = {key: archive[key] for key in ("weights", "means", "covariances")}
        except FileNotFoundError:
            raise
        except (OSError, EOFError, zipfile.BadZipFile, ValueError) as err:
            if str(err).startswith(not_ours):
                raise
            if "Object arrays" in str(err):  # numpy's advice (allow_pickle) is exactly what must not be done
                raise ValueError(f"{not_ours}: it holds Python objects, which are never loaded") from None
            raise ValueError(f"{not_ours}: it is empty, truncated or of another format ({err.__class__.__name__})") from None
        if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
            version = meta.get("format_version") if isinstance(meta, dict) else None
            raise ValueError(f"{path}: unsupported model format version {version!r} (this version reads {FORMAT_VERSION})")
        if any(a.dtype.kind != "f" for a in arrays.values()):
            raise ValueError(f"{path}: weights, means and covariances must be floating-point arrays")
        mixture = Mixture(*(torch.as_tensor(arrays[k], dtype=torch.float64) for k in ("weights", "means", "covariances")))
        mixture.check(f"model {path}")
        params = dict(meta.get("params", {}))
        if device is not None:
            params["device"] = device
        elif params.get("device", "cpu") != "cpu" and not torch.cuda.is_available():
            params["device"] = "cpu"
        try:
            model = cls(**params)
        except (TypeError, ValueError) as err:
            raise ValueError(f"model {path} has invalid settings: {err}") from None
        if model.n_components != mixture.n_components:
            raise ValueError(f"model {path}: n_components is {model.n_components} but it holds "
                             f"{mixture.n_components} components")  # fmt: skip
        model._set_fitted(mixture.to(model._device), meta.get("history", []), meta.get("converged", False))
        return model
