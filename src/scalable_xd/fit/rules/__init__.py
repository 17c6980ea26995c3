"""The update rules: how each method turns a batch's sums (q, U, UU, P) into new parameters, a room a rule.

Each rule is defined once, in torch, and its compiled forms sit beside it, named after it:

* ``em``: batch EM's update (Bovy, Hogg & Roweis 2011), and what every rule shares (W, fixed parameters, the
  E-step mixture's prior, rounding's clipping);
* ``online_em``: online EM's (Cappe & Moulines 2009), the rule of the method ``"minibatch_em"``;
  ``online_em_numba`` (the CPU), ``online_em_triton`` (CUDA), ``online_em_graphed`` (a replayed CUDA graph's
  step);
* ``sgd``: SGD's Cholesky parameters, their gradient and Adam's step (paper section 3.2); ``sgd_numba``,
  ``sgd_triton``, ``sgd_graphed`` alike.

Each compiled form follows its torch definition operation for operation and is tested equal to it
(``tests/fit/test_cpu_rules.py``, ``tests/fit/test_cuda_rules.py``). ``forms`` says which form runs where.
Fitters (``fit.families.minibatch_em``, ``fit.families.sgd``, ...) and engines (``fit.engines``) import the
rules, never each other's insides.
"""
