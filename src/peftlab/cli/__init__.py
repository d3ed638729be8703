"""The ``peftlab`` command line (:mod:`peftlab.cli.main`)."""
