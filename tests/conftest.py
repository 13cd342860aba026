"""Shared fixtures, from :mod:`tests.support`: tiny models, daemons, clusters, the browser."""

pytest_plugins = [
    "tests.support.fixtures",
    "tests.support.daemons",
    "tests.support.cluster",
    "tests.support.browser",
]
