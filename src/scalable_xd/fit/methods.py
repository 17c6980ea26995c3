"""The table of fitting methods: everything the rest of the code asks about a method, written once.

A row says how the method runs (an update per batch or per epoch, whether ``tol`` stops it), which options
it takes (split-and-merge, Polyak averaging, truncation) and which fitter runs it. The settings' choices
and cross-checks (``check_settings``: the settings themselves import nothing of the package), the epoch
budget (``for_data``), the loop's configuration, the workflow schema's method list (held equal by a
test), the report's order and the claims' method set all come from here; the report's labels and colours
from its own table (``pipeline.report.style.LOOKS``). Adding a method is one ``Method`` in ``METHODS``
plus its fitter class (see ``fitters.Fitter``), and a look in the report's table where it is shown.

The table itself imports no torch (the settings and the command line's help read it); the fitters are
imported when one is built.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ..kernel import BACKENDS

if TYPE_CHECKING:
    import torch

    from ..mixture import Mixture
    from ..settings import FitSettings
    from .families.batch_em import BatchEM
    from .families.minibatch_em import MinibatchEM
    from .families.sgd import SGD
    from .families.squarem import SquaremEM
    from .fitters import Fitter, TrialFitter
    from .rules.em import FixedParameters


@dataclass(frozen=True)
class Method:
    """One fitting method.

    ``per_batch``: it updates after every minibatch (batches shuffled each epoch, of ``batch_size``), and
    so can be averaged; otherwise it sums the statistics of an epoch for one update (in-order batches of
    the evaluation size). ``uses_tol``: ``tol`` stops it once an iteration improves the training
    log-likelihood by less. ``split_merge``: how it takes split-and-merge moves, ``"converged"`` (after
    convergence by ``tol``, Bovy et al. 2011), ``"epoch"`` (one trial an epoch, judged on a validation
    sample) or None (not at all). ``truncation``: it can run Nguyen, Forbes & McLachlan's truncated form.
    ``naive_update``: ``covariance_update="naive"`` gives it the paper's eq. 7, whose raw sums keep no
    fixed parameters.
    ``in_paper``: one of the three methods Ritchie & Murray (2019) compare, whose claims the report checks.
    ``build(settings, mixture, fixed, data_size, w)`` returns its fitter (``data_size``: the training data's
    total weight, which minibatch EM's prior regularisation is scaled by; ``w``: the regularisation per
    feature, ``fit.regularisation``). ``epochs`` and ``min_updates``:
    its default budget (``budget``), in which its default settings reached 90% of the achievable on the
    documentation's mocks (docs/user-guide/converged.md) (``pipeline.truth``).
    """

    name: str
    per_batch: bool
    build: Callable[[FitSettings, Mixture, FixedParameters | None, float, torch.Tensor | None], Fitter]
    uses_tol: bool = False
    split_merge: str | None = "epoch"
    truncation: bool = False
    naive_update: bool = False
    in_paper: bool = False
    epochs: int = 20
    min_updates: int = 0

    def budget(self, n_points: int, batch_size: int) -> int:
        """The default number of epochs: ``epochs``, or more where a minibatch method needs them to make
        ``min_updates`` updates on few points (its progress is counted in steps, not passes), but no more
        passes than batch EM's budget where an epoch makes at least ``SMALL_DATA_UPDATES`` updates (as
        ``default_batch`` sees to): there each update is a small share of the data, and more passes only
        cost time. An epoch makes N // batch_size updates, at least one: a remainder joins the last batch
        (``batch_bounds``)."""
        if not self.per_batch:
            return self.epochs
        updates = max(1, n_points // batch_size)
        epochs = math.ceil(self.min_updates / updates)
        if updates >= SMALL_DATA_UPDATES:
            epochs = min(epochs, METHODS["em"].epochs)
        return max(self.epochs, epochs)


BATCH_SIZE = 500  # the paper's minibatch, the default wherever the data hold SMALL_DATA_UPDATES of them
SMALL_DATA_UPDATES = 20  # updates an epoch at least at the default batch size, down to MIN_BATCH_SIZE points
MIN_BATCH_SIZE = 8


def default_batch(n_points: int) -> int:
    """The batch size left to the library: the paper's 500, or on fewer than 10,000 points N // 20 (at
    least 8), so that a minibatch method takes many small steps an epoch rather than one step over nearly
    all the data (on 894 stars of 20 features: 3,000 passes at batch 500, 100 at batch 44 in a 25th of
    the time, 0.02 nats a star lower on the training stars; docs/user-guide/converged.md). So down to 160
    points an epoch makes 20 updates, and the budget stays at batch EM's passes (on 300 points a floor of
    32 made 9 updates an epoch and 667 passes of SGD, 6 to 12 times batch EM's time)."""
    return min(BATCH_SIZE, max(MIN_BATCH_SIZE, n_points // SMALL_DATA_UPDATES))


def _batch_em(s: FitSettings, mixture: Mixture, fixed, w, stochastic: bool) -> BatchEM | SquaremEM:
    from .families.batch_em import BatchEM
    from .families.squarem import SquaremEM

    if s.acceleration == "squarem" and not stochastic:
        return SquaremEM(mixture, w=w, fixed=fixed)
    return BatchEM(mixture, w=w, fixed=fixed, stochastic=stochastic)


def _build_minibatch_em(s: FitSettings, mixture: Mixture, fixed, w, stochastic: bool, data_size: float) -> MinibatchEM:
    from .families.minibatch_em import MinibatchEM

    return MinibatchEM(
        mixture,
        w=w,
        step_size=s.step_size,
        schedule=s.step_schedule,
        step_decay=s.step_decay,
        decay_epoch=_resolved(s.decay_epoch, "decay_epoch"),
        kappa=s.kappa,
        covariance_update=s.covariance_update,
        fixed=fixed,
        stochastic=stochastic,
        truncation=s.truncation_bound if s.truncation else None,
        data_size=data_size if s.online_regularisation == "prior" else None,
        reseed_size=data_size if s.reseed_dead else None,
    )


def _build_sgd(s: FitSettings, mixture: Mixture, fixed, data_size: float, w) -> SGD:
    from .families.sgd import SGD

    return SGD(
        mixture,
        w=w,
        lr=s.lr,
        lr_decay=s.lr_decay,
        decay_epoch=_resolved(s.decay_epoch, "decay_epoch"),
        scaling=s.sgd_scaling,
        fixed=fixed,
    )


# In the order the report shows them: the paper's three, then stochastic EM (Celeux & Diebolt 1985).
METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method(
            "em",
            per_batch=False,
            build=lambda s, mixture, fixed, n, w: _batch_em(s, mixture, fixed, w, stochastic=False),
            uses_tol=True,
            split_merge="converged",
            in_paper=True,
            epochs=100,
        ),
        Method(
            "minibatch_em",
            per_batch=True,
            build=lambda s, mixture, fixed, n, w: _build_minibatch_em(
                s, mixture, fixed, w, stochastic=False, data_size=n
            ),
            truncation=True,
            naive_update=True,
            in_paper=True,
            min_updates=3_000,
        ),
        Method("sgd", per_batch=True, build=_build_sgd, in_paper=True, min_updates=6_000),
        Method(
            "stochastic_em",
            per_batch=False,
            build=lambda s, mixture, fixed, n, w: _batch_em(s, mixture, fixed, w, stochastic=True),
            split_merge=None,
        ),
        Method(
            "stochastic_minibatch_em",
            per_batch=True,
            build=lambda s, mixture, fixed, n, w: _build_minibatch_em(
                s, mixture, fixed, w, stochastic=True, data_size=n
            ),
            truncation=True,
            naive_update=True,
            min_updates=3_000,
        ),
    )
}


# The choices of the settings whose vocabularies the fit's parts own (``settings`` imports neither), for
# whoever shows them: the command line's options, the estimator's docstring.
SETTING_CHOICES = {"method": tuple(METHODS), "backend": BACKENDS}


def setting_help(name: str, text: str) -> str:
    """A setting's help as the command line, the estimator's docstring and the config's README show it:
    ``epochs``'s gains each method's own budget, which this table holds."""
    if name != "epochs":
        return text
    budgets = ", ".join(
        f"{m.name} {m.epochs}"
        + (" (stopped sooner by tol)" if m.uses_tol else "")
        + (f" or enough for {m.min_updates:,} updates" if m.min_updates else "")
        for m in METHODS.values()
    )
    return f"{text}: {budgets}"


def check_settings(s: FitSettings) -> FitSettings:
    """``s``, or a ValueError where its method is unknown or it asks its method for what the method's row
    does not allow (averaging, split-and-merge, truncation); its backend is checked by the kernel."""
    row = method(s.method)
    if s.averaging != "none" and not row.per_batch:
        raise ValueError(
            f"averaging={s.averaging!r} averages minibatch updates; method {s.method!r} makes one update "
            f"per epoch (use one of {_methods_where('per_batch')})"
        )
    if s.split_merge and row.split_merge == "converged" and not s.tol:
        raise ValueError(
            f"split_merge with method {s.method!r} needs a positive tolerance tol (moves are tried once the "
            f"fit has converged by tol, which tol = {s.tol} never declares)"
        )
    if s.split_merge and (row.split_merge is None or s.averaging != "none" or s.truncation):
        raise ValueError(f"split_merge works with {_methods_where('split_merge')}, without averaging or truncation")
    if s.truncation and not row.truncation:
        raise ValueError(f"truncation applies to {_methods_where('truncation')}, not {s.method!r}")
    return s


def check_fixed(s: FitSettings, fixed: bool) -> None:
    """A ValueError where parameters are held at their initial values (``fixed``: any of ``fix_weights``,
    ``fix_means``, ``fix_covariances``) in a fit that cannot keep them: asked before any work is done."""
    if not fixed:
        return
    if s.split_merge:
        raise ValueError("split_merge moves components, so it cannot keep fixed parameters")
    if s.covariance_update == "naive" and method(s.method).naive_update:
        raise ValueError("fixed parameters need covariance_update='stable' (the naive update keeps raw sums)")


def for_data(s: FitSettings, n_points: int) -> FitSettings:
    """``s`` with the budget resolved for ``n_points`` training points: ``batch_size`` None becomes
    ``default_batch``'s, ``epochs`` None the method's own (``Method.budget``), ``decay_epoch`` None half
    of the epochs (rounded up, so that a one-epoch fit takes its full step)."""
    batch_size = default_batch(n_points) if s.batch_size is None else s.batch_size
    epochs = method(s.method).budget(n_points, batch_size) if s.epochs is None else s.epochs
    decay_epoch = (epochs + 1) // 2 if s.decay_epoch is None else s.decay_epoch
    return replace(s, batch_size=batch_size, epochs=epochs, decay_epoch=decay_epoch)


def _resolved(value, name: str):
    """A setting that is None until resolved (``for_data``'s budget; ``tol`` where ``check_settings`` asks
    for one), once it has been."""
    if value is None:
        raise ValueError(f"{name} must be resolved before a fitter is built (methods.for_data, check_settings)")
    return value


def _trial(fitter: Fitter) -> TrialFitter:
    """``fitter`` as what stochastic split-and-merge runs trials of (``fitters.TrialFitter``)."""
    from .fitters import TrialFitter

    if not isinstance(fitter, TrialFitter):
        raise ValueError(f"split_merge cannot run trials beside a {type(fitter).__name__}")
    return fitter


def _methods_where(fact: str) -> str:
    """The names of the methods whose row has ``fact``, for error messages."""
    return ", ".join(m.name for m in METHODS.values() if getattr(m, fact))


def method(name: str) -> Method:
    """The row of ``name``, or a ValueError listing the methods."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}: choose one of {', '.join(METHODS)}")
    return METHODS[name]


def paper_methods(per_batch: bool | None = None) -> list[str]:
    """The paper's methods (only its minibatch ones, or only its batch one, where ``per_batch`` says)."""
    return [m.name for m in METHODS.values() if m.in_paper and per_batch in (None, m.per_batch)]


def make_fitter(
    settings: FitSettings,
    mixture: Mixture,
    fixed: FixedParameters | None = None,
    judge: Callable[[Mixture], float] | None = None,
    *,
    data_size: float,
    w: torch.Tensor | None,
) -> Fitter:
    """The fitter of ``settings.method``, starting from ``mixture``, with ``fixed`` parameters held;
    ``judge`` scores a mixture on a fixed validation sample (split-and-merge of the ``"epoch"`` kind);
    ``data_size``: the training data's total weight; ``w``: the regularisation per feature (see
    ``Method``)."""
    from .families.averaging import PolyakAverage
    from .families.split_merge import SplitMergeEM, StochasticSplitMerge

    s, row = settings, method(settings.method)
    if s.split_merge and row.split_merge == "converged":
        tol = _resolved(s.tol, "tol")  # check_settings asks split_merge of this kind for one
        return SplitMergeEM(mixture, w=w, tol=tol, tries=s.split_merge_tries)  # no fixed ones: check_fixed
    if s.split_merge:  # with no fixed parameters: check_fixed refused them before any work
        if judge is None:
            raise ValueError("split_merge judged each epoch needs a judge: a fixed sample to score its trials on")
        plain = dataclasses.replace(s, split_merge=False)
        return StochasticSplitMerge(
            _trial(row.build(plain, mixture, None, data_size, w)),
            judge=judge,
            tries=s.split_merge_tries,
            make_fitter=lambda start, held: _trial(make_fitter(plain, start, held, data_size=data_size, w=w)),
        )
    fitter = row.build(s, mixture, fixed, data_size, w)
    return PolyakAverage(fitter) if s.averaging == "polyak" else fitter
