"""Ending the process: its exit statuses, and leaving without interpreter teardown."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import NoReturn

# The daemon could not start: a busy port, a cluster that cannot form or serve the model.
EXIT_REFUSED = 2


def exit_now(code: int) -> NoReturn:
    """Leave without interpreter teardown, once everything is flushed.

    The engines have stopped and released their MLX objects (or cannot, when
    a cluster is lost); skipping teardown keeps MLX's static destructors from
    racing objects Python frees late (seen as "terminate called without an
    active exception").
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
