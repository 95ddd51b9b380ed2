"""``r1fit doctor``: the facts of this machine a bug report needs (:mod:`r1fit.doctor.env`), and
``--check``, a self-check of about a minute on the first device (:mod:`r1fit.doctor.selfcheck`):
the planner against a measured peak, the shared-prompt and shared-prefill checks on this
device's kernels, a run killed and resumed against an uninterrupted one.

The package sits above ``r1fit.train``: the self-check runs GRPO (in child processes, as
``r1fit train`` runs) and loads a model the way a run does."""
