#!/usr/bin/env python
"""Embedding throughput: embeddings per second at batch sizes 1 and 32.

**Engine** (always): one :class:`~mlxd.engine.embeddings.engine.EmbeddingEngine` per
batch size (``[models.<id>.batch] size``), no HTTP. ``--inputs`` single-text
requests are queued at once, as concurrent clients would send them, and the
engine batches them up to the batch size per forward pass. A warm-up round
runs first; each size is measured ``--repeats`` times, the median is shown.

**HTTP** (``--http``): the same texts through a real ``mlxd serve`` (a tiny
chat model plus the embedding model in its registry), sent as
``--inputs`` concurrent ``POST /v1/embeddings`` of one text each, from
``--clients`` threads, once per batch size (the daemon restarted with that
``batch.size``).

Usage: ``python benchmarks/embeddings.py [--model DIR | --shape tiny|minilm] [--batch-sizes 1,32]
[--inputs 256] [--words 24] [--repeats 3] [--http] [--blas auto|off|PATH]``. Without ``--model`` it
uses the tiny random-weight BERT of the tests (built locally, cached), or with
``--shape minilm`` a random BERT the size of all-MiniLM-L6-v2. A
Markdown table goes to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

_SENTENCE = (
    "the river runs past the old mill every morning and the people of the town walk "
    "along its banks before the shops open some carry bread from the bakery others "
    "watch the water in the spring it is high and brown in summer low and clear"
)
WORDS = _SENTENCE.split()


def texts(count: int, words: int) -> list[str]:
    """``count`` different texts of ``words`` words each (a rotating window of WORDS)."""
    return [
        " ".join(WORDS[(i + j) % len(WORDS)] for j in range(words)) + f" {i}" for i in range(count)
    ]


def make_settings(path: str, batch: int, chat_path: str):
    from mlxd.config import load_settings
    from mlxd.config.registry import for_model

    entry = {"path": path, "kind": "embedding", "batch": {"size": batch}}
    settings = load_settings(
        None, overrides={"models": {"chat": {"path": chat_path}, "emb": entry}}
    )
    return for_model(settings, "emb")


def embedded(future: Future[Any]) -> Any:
    """A request's EmbeddingResult; a Failed value (the engine's refusal) ends the run."""
    from mlxd.engine.messages import Failed

    result = future.result()
    if isinstance(result, Failed):
        raise SystemExit(f"an embedding request failed: {result}")
    return result


def run_engine(path: str, batch: int, inputs: list[str], repeats: int) -> dict:
    from mlxd.engine.embeddings.engine import EmbeddingEngine

    engine = EmbeddingEngine(make_settings(path, batch, path), "emb", load_at_start=True)
    engine.start()
    if not engine.wait_loaded(600):
        raise SystemExit(f"the model did not load: {engine.load_error}")
    try:
        for f in [engine.submit([t]) for t in inputs[: max(batch, 4)]]:
            embedded(f)
        rates, passes = [], []
        for _ in range(repeats):
            before = engine.snapshot().forward_passes
            started = time.perf_counter()
            futures = [engine.submit([t]) for t in inputs]
            tokens = sum(embedded(f).prompt_tokens for f in futures)
            elapsed = time.perf_counter() - started
            rates.append(len(inputs) / elapsed)
            passes.append(engine.snapshot().forward_passes - before)
        info = engine.info
        assert info is not None
        return {
            "rate": statistics.median(rates),
            "passes": statistics.median(passes),
            "tokens": tokens,
            "dims": info.dimensions,
            "family": info.family,
        }
    finally:
        engine.stop()


def run_http(path: str, batch: int, inputs: list[str], clients: int) -> float:
    from tests.support.daemon import Daemon, toml_config
    from tests.support.tinymodels import tiny_model_dir

    with tempfile.TemporaryDirectory() as tmp:
        config = toml_config(
            models={
                "chat": {"path": str(tiny_model_dir("llama")), "default": True},
                "emb": {"path": path, "kind": "embedding", "batch": {"size": batch}},
            }
        )
        daemon = Daemon(Path(tmp), config).start()
        try:
            with daemon.client() as http:

                def one(text: str) -> None:
                    r = http.post("/v1/embeddings", json={"model": "emb", "input": text})
                    r.raise_for_status()

                for t in inputs[:4]:
                    one(t)
                started = time.perf_counter()
                with ThreadPoolExecutor(clients) as pool:
                    list(pool.map(one, inputs))
                return len(inputs) / (time.perf_counter() - started)
        finally:
            daemon.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="an embedding model directory (default: the tiny BERT)")
    parser.add_argument(
        "--shape",
        choices=("tiny", "minilm"),
        default="tiny",
        help="without --model: the tests' tiny BERT, or a random BERT of all-MiniLM-L6-v2's "
        "size (384 dimensions, 6 layers, 22M parameters; built in a temporary directory)",
    )
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--inputs", type=int, default=256, help="texts per measurement")
    parser.add_argument("--words", type=int, default=24, help="words per text")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--http", action="store_true", help="also through a real daemon")
    parser.add_argument("--clients", type=int, default=32, help="HTTP client threads")
    parser.add_argument(
        "--blas", default="auto", help="as [runtime] blas: auto (OpenBLAS if found), off, a path"
    )
    args = parser.parse_args()
    # As the daemon does: re-exec once with an optimized BLAS, before MLX loads.
    from mlxd.runtime.blas import ensure_blas

    ensure_blas(args.blas, None, sys.argv)

    scratch = tempfile.TemporaryDirectory()
    if args.model:
        path = str(Path(args.model).expanduser())
    elif args.shape == "minilm":
        from tests.support.tinyembed import MINILM_SHAPE, build_tiny_embedding

        path = str(build_tiny_embedding(Path(scratch.name) / "minilm", shape=MINILM_SHAPE))
    else:
        from tests.support.tinyembed import tiny_embedding_dir

        path = str(tiny_embedding_dir())
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    inputs = texts(args.inputs, args.words)
    rows = []
    for size in sizes:
        print(f"engine, batch {size} ...", file=sys.stderr)
        result = run_engine(path, size, inputs, args.repeats)
        if args.http:
            print(f"http, batch {size} ...", file=sys.stderr)
            result["http"] = run_http(path, size, inputs, args.clients)
        rows.append((size, result))

    from mlxd.runtime.blas import mapped_blas

    first = rows[0][1]
    print(
        f"model: {path} ({first['family']}, {first['dims']} dimensions), BLAS "
        f"{mapped_blas().name}; "
        f"{args.inputs} texts of {args.words} words ({first['tokens']} tokens), "
        f"one text per request, median of {args.repeats}\n"
    )
    header = "| batch size | forward passes | engine embeddings/s |"
    rule = "| ---: | ---: | ---: |"
    if args.http:
        header += " HTTP embeddings/s |"
        rule += " ---: |"
    print(header)
    print(rule)
    for size, r in rows:
        line = f"| {size} | {r['passes']:.0f} | {r['rate']:.1f} |"
        if args.http:
            line += f" {r['http']:.1f} |"
        print(line)


if __name__ == "__main__":
    main()
