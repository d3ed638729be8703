"""Training: one run from config to result (``setup -> fit -> finish``), its run folder, and reloading a saved run
(``evaluate``, ``predict``, ``export``)."""
