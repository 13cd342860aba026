"""Shared fixtures, from :mod:`tests.support`: tiny models, daemons, in-process apps,
clusters, the browser."""

import atexit
import os
import shutil
import tempfile

# The suite's state (the prompt cache's disk tier) never lands in the user's own
# state directory: every engine and daemon of the session shares a throwaway one.
_STATE_DIR = tempfile.mkdtemp(prefix="mlxd-test-state-")
os.environ["MLXD_SERVER__STATE_DIR"] = _STATE_DIR
atexit.register(shutil.rmtree, _STATE_DIR, ignore_errors=True)

pytest_plugins = [
    "tests.support.fixtures",
    "tests.support.daemons",
    "tests.support.inprocess",
    "tests.support.cluster",
    "tests.support.browser",
]
