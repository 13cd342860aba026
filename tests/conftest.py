"""Shared fixtures, from :mod:`tests.support`: the tiny models per cache family."""

pytest_plugins = ["tests.support.fixtures"]
