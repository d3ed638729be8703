"""Test support (tests/test_extras.py): make the modules ``PEFTLAB_TEST_BLOCK`` names missing, as in an
interpreter without them (``sys.modules[name] = None``: importing one raises ModuleNotFoundError and
``importlib.util.find_spec`` returns None, which is how peftlab and the libraries ask), and at exit print on stderr
which of ``PEFTLAB_TEST_WATCH``'s modules were imported (``WATCHED=[...]``)."""

import atexit
import json
import os
import sys

BLOCK = tuple(filter(None, os.environ.get("PEFTLAB_TEST_BLOCK", "").split(",")))
WATCH = tuple(filter(None, os.environ.get("PEFTLAB_TEST_WATCH", "").split(",")))
for name in BLOCK:
    sys.modules[name] = None


def report() -> None:
    print("\nWATCHED=" + json.dumps(sorted(m for m in WATCH if sys.modules.get(m) is not None)), file=sys.stderr)


if WATCH:
    atexit.register(report)
