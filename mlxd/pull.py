"""``mlxd pull org/name``: the fit check against the config, a download with progress.

The command asks the hub for the repo's listing and ``config.json``, says
whether the model fits the config's ``[memory] budget`` beside the models the
config pins (refusing before any weight byte is fetched unless ``--force``),
then downloads into the shared Hugging Face cache (:mod:`mlxd.hub`) with a
progress line on stderr, and prints the snapshot directory last, on stdout.
Errors are one line on stderr with a non-zero exit status: 1 for a repo
that cannot be pulled, 3 for a model that does not fit, 130 when
interrupted (the next pull resumes).
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

from mlxd.config import Settings, format_bytes
from mlxd.config.registry import for_model, registry
from mlxd.hub import (
    Cancelled,
    FitVerdict,
    HubError,
    Listing,
    Progress,
    fetch_listing,
    fit_verdict,
    kv_bytes_per_token,
    pull,
)
from mlxd.hub.fit import context_length

EXIT_FAILED, EXIT_DOES_NOT_FIT, EXIT_INTERRUPTED = 1, 3, 130
# How often a progress line is written when stderr is not a terminal.
LOG_EVERY_S = 2.0


def configured_fit(settings: Settings, listing: Listing, device_bytes: int) -> FitVerdict:
    """The fit check of ``listing`` against ``settings``: the budget, the models it pins."""
    from mlxd.engine.fleet.slot import budget_bytes, estimate_weights

    budget = budget_bytes(settings, device_bytes)
    others = 0
    own = None
    for model_id, entry in registry(settings).items():
        if entry.repo == listing.repo:
            own = for_model(settings, model_id)
        elif entry.pin:
            cap = for_model(settings, model_id).prompt_cache.max_bytes
            others += estimate_weights(entry) + (cap if entry.kind == "chat" else 0)
    model_settings = own or settings
    max_context = model_settings.model.max_context or context_length(listing.config)
    return fit_verdict(
        weights=listing.weights_bytes,
        kv_per_token=kv_bytes_per_token(listing.config),
        budget=budget,
        others=others,
        reserve=model_settings.prompt_cache.max_bytes,
        max_context=max_context,
    )


def _device_bytes(settings: Settings) -> int:
    if settings.memory.budget != "auto":
        return 0  # not read
    try:
        from mlxd.engine.chat.loading import device_memory_bytes

        return device_memory_bytes()
    except Exception:
        import os

        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def progress_line(p: Progress) -> str:
    """``3/6 files, 412 MiB of 1.2 GiB (35%), 24.1 MiB/s, 0:35 left``."""
    pct = 100 * p.bytes_done // p.bytes_total if p.bytes_total else 100
    line = (
        f"{p.files_done}/{p.files_total} files, {format_bytes(p.bytes_done)} of "
        f"{format_bytes(p.bytes_total)} ({pct}%)"
    )
    if p.speed > 0:
        line += f", {format_bytes(p.speed)}/s"
    if p.eta is not None and p.bytes_done < p.bytes_total:
        minutes, seconds = divmod(int(p.eta), 60)
        line += f", {minutes}:{seconds:02d} left"
    return line


class _Printer:
    """Progress on stderr: one line redrawn on a terminal, a line every few seconds otherwise."""

    def __init__(self, out: TextIO):
        self._out = out
        self._tty = out.isatty()
        self._last = 0.0
        self._lock = threading.Lock()

    def __call__(self, p: Progress) -> None:
        now = time.monotonic()
        with self._lock:
            if self._tty:
                self._out.write("\r" + progress_line(p).ljust(72))
            elif now - self._last >= LOG_EVERY_S or p.bytes_done >= p.bytes_total:
                self._out.write(progress_line(p) + "\n")
            else:
                return
            self._last = now
            self._out.flush()

    def done(self) -> None:
        if self._tty:
            self._out.write("\n")


def run(args: Any, settings: Settings) -> int:
    """``mlxd pull``; ``args`` has ``repo``, ``revision``, ``force``."""
    err = sys.stderr
    repo, revision = args.repo, args.revision
    try:
        listing = fetch_listing(repo, revision)
    except HubError as exc:
        print(exc, file=err)
        return EXIT_FAILED
    verdict = configured_fit(settings, listing, _device_bytes(settings))
    print(
        f"{repo}: {format_bytes(listing.total_bytes)} in {len(listing.sizes)} files; "
        f"{verdict.message}",
        file=err,
    )
    if not verdict.fits:
        if not args.force:
            print(f"{repo}: not downloaded (--force downloads it anyway)", file=err)
            return EXIT_DOES_NOT_FIT
        print(f"{repo}: downloading anyway (--force)", file=err)
    cancel = threading.Event()
    previous = {s: signal.signal(s, lambda *_: cancel.set()) for s in _SIGNALS}
    printer = _Printer(err)
    try:
        path = pull(repo, revision, listing=listing, on_progress=printer, cancel=cancel)
    except Cancelled:
        printer.done()
        print(f"{repo}: interrupted; `mlxd pull {repo}` resumes where it stopped", file=err)
        return EXIT_INTERRUPTED
    except HubError as exc:
        printer.done()
        print(exc, file=err)
        return EXIT_FAILED
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    printer.done()
    print(str(Path(path)))
    return 0


_SIGNALS = (signal.SIGINT, signal.SIGTERM)
