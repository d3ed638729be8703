"""Lab: many runs as data.

Running: ``spec`` (a sweep spec expanded into runs), ``runner`` (one run, and the executors: in process, worker
processes in ``sweep_workers``, Ray tasks in ``ray_backend``), ``sweep`` (runs a spec), ``tune/`` (budgeted
search) and ``store`` (the SQLite results store). Reading: ``records`` (the one place that collects run records
from stores and run folders), ``report`` (the table: grouping with pandas), ``stats`` (t-tests,
Benjamini-Hochberg), ``tables`` (md/latex/csv), ``plot`` and its ``figures/``.

May import: ``peftlab.errors``, ``peftlab.config`` (the schema), ``peftlab.tasks.table`` (task metadata);
``runner``, ``sweep``, ``tune`` and ``ray_backend`` also run ``peftlab.training``. Reports and plots never import
method or model code: everything they show comes from the records (result.json).
"""
