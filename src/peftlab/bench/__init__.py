"""Bench: what methods and the data path cost (time, memory, parameters), recorded as JSON and Markdown.

``micro`` (per-method costs) and ``e2e`` (the data path end to end) run on ``timing`` (clock, round-robin
pairing, statistics), ``memory``, ``machine`` (device, precision, environment) and ``models``; ``render``
writes the tables; ``cli`` is ``peftlab bench`` / ``python -m peftlab.bench``.

May import anything but the lab and the CLI's entry point.
"""
