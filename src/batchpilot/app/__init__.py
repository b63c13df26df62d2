"""The demo application on top of the library: the ``batchpilot`` command, reports, the main job.

Nothing in the library imports this package. Its modules: :mod:`~batchpilot.app.cli`
(``batchpilot find | plan | train``), :mod:`~batchpilot.app.trainjob` (the main job),
:mod:`~batchpilot.app.report` (tables, plots, JSON schemas), :mod:`~batchpilot.app.datasets`
(the bundled digits) and :mod:`~batchpilot.app.models` (small reference models the job, the
tests and the benchmarks build).
"""

__all__ = ["cli", "datasets", "models", "report", "trainjob"]
