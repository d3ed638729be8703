"""Training: one run from config to result.

Owns the loop (``setup -> fit -> finish``), the run folder (guard, atomic writes, checkpoints, result.json),
reloading a saved run (``evaluate``, ``predict``, ``export``) and the accelerator / precision choice.

May import: ``peftlab.errors``, ``peftlab.config``, ``peftlab.models.registry``, ``peftlab.methods.table``, ``peftlab.tasks.table``.
Never the lab, bench or the CLI's entry point.
"""
