"""Lab: many runs as data.

Owns sweeps (grids, workers, resume), the SQLite results store, and the reports and plots that read run
records (``records``) only.

May import: ``peftlab.errors``, ``peftlab.config`` (the schema), ``peftlab.tasks.table`` (task metadata);
``sweep`` also runs ``peftlab.training``. Reports and plots never import method or model code.
"""
