"""The fixed-rate study protocol (the earlier designs of ``peftlab study``), beside the package: see cli.py."""
