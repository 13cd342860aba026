"""How many bytes a model's arrays hold (what its weights count in the memory budget)."""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx
from mlx.utils import tree_reduce


def nbytes(tree: Any) -> int:
    """The bytes of every ``mx.array`` in ``tree`` (a module, or its parameters)."""
    # mlx.utils is unannotated: a sum of ints from 0 is an int.
    return cast(
        int, tree_reduce(lambda acc, x: acc + x.nbytes if isinstance(x, mx.array) else acc, tree, 0)
    )
