"""``peftlab tune``: :mod:`.run` (the search, seed re-runs and held-out check; the command), :mod:`.spec` (the
tune spec: space, budget, pruner, seeds), :mod:`.study` (the Optuna study), :mod:`.summary` (winner by seed
means, held-out score, tune.json)."""
