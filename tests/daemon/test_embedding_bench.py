"""``benchmarks/embeddings.py`` runs end to end on the tiny BERT (that it works, not how fast)."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.support import ROOT


def test_the_embeddings_benchmark_prints_a_row_per_batch_size(tiny_embedding_model):
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "embeddings.py"), "--model",
        str(tiny_embedding_model), "--batch-sizes", "1,4", "--inputs", "16", "--repeats", "1",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = re.findall(r"^\| (\d+) \| (\d+) \| ([0-9.]+) \|$", done.stdout, re.MULTILINE)
    assert [size for size, _, _ in rows] == ["1", "4"], done.stdout
    # One text per pass at size 1; at size 4, what each round finds tokenized, 4 at most.
    assert int(rows[0][1]) == 16 and 4 <= int(rows[1][1]) <= 16, done.stdout
    assert all(float(rate) > 0 for _, _, rate in rows)
    assert "bert, 64 dimensions" in done.stdout
