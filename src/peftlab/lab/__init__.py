"""Lab: many runs as data.

Running: ``spec`` (a sweep spec expanded into runs), ``sweep`` (runs them, in process or in workers; also
``ray_backend``), ``tune`` (budgeted search) and ``store`` (the SQLite results store). Reading: ``records`` (the
one place that collects run records from stores and run folders), ``report`` (the table: grouping with pandas),
``stats`` (t-tests, Benjamini-Hochberg), ``tables`` (md/latex/csv), ``plot`` and its ``figures*`` modules.

May import: ``peftlab.errors``, ``peftlab.config`` (the schema), ``peftlab.tasks.table`` (task metadata);
``sweep`` and its runners also run ``peftlab.training``. Reports and plots never import method or model code:
everything they show comes from the records (result.json).
"""
