"""Tasks: what a run trains on and how it is scored.

Owns the task table, locating and reading data (local files first, then the Hub, else one clear error),
tokenisation and batching, metrics, answer extraction, and :class:`~peftlab.tasks.prepare.Pipeline`:
the training set, collator and ``evaluate(model, accelerator, tag)`` a run needs from its task.

May import: ``peftlab.errors``, ``peftlab.models.registry`` (cache paths). Never training, methods, the lab or the CLI.
"""
