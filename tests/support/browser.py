"""The headless Chromium the browser tests drive (through Playwright), shared while they run.

Fixtures (registered in ``tests/conftest.py``):

- ``browser``: the session's Chromium (``playwright.sync_api.Browser``), launched at
  the first test that asks for it with :data:`CHROMIUM_ARGS`;
- ``pages``: a factory ``pages(**context_options) -> Page`` of pages in fresh
  browser contexts (own cookies), all closed when the test ends.

Playwright's sync API keeps an event loop running on the main thread while it is
started, so ``asyncio.run`` fails meanwhile: Chromium is closed after each run of
consecutive browser tests (most live together in tests/dashboard, so it is
launched a few times a session, not once per test).

Helpers: ``with frozen(page):`` holds htmx's polled regions still while a test reads
several things from them; ``wait_for_swap(page, selector)`` waits for a poll to
replace a region.
Without Chromium the tests skip, unless ``MLXD_REQUIRE_BROWSER=1`` (CI) makes that
a failure.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

CHROMIUM = os.environ.get("MLXD_CHROMIUM", "/usr/bin/chromium")
# Headless flags for Debian's Chromium as root on a machine with no network
# beyond loopback (no background connections, no first-run work).
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
]

__all__ = [
    "CHROMIUM",
    "CHROMIUM_ARGS",
    "Chromium",
    "browser",
    "frozen",
    "pages",
    "require_browser",
    "wait_for_swap",
]


def require_browser() -> str:
    """The Chromium binary, or skip (fail under CI, where MLXD_REQUIRE_BROWSER=1)."""
    for candidate in (CHROMIUM, "chromium", "chromium-browser", "google-chrome"):
        found = candidate if os.access(candidate, os.X_OK) else shutil.which(candidate)
        if found:
            return found
    message = (
        f"Chromium not found (tried {CHROMIUM}, chromium, chromium-browser, google-chrome): "
        "install Debian's 'chromium' package to run browser tests"
    )
    if os.environ.get("MLXD_REQUIRE_BROWSER") == "1":
        pytest.fail(message)
    pytest.skip(message)


class Chromium:
    """Playwright and one Chromium, started on first use and closed on demand."""

    def __init__(self) -> None:
        self._playwright: Any = None
        self._browser: Any = None
        self.launches = 0

    def get(self) -> Any:
        if self._browser is None:
            path = require_browser()
            try:
                from playwright.sync_api import sync_playwright
            except ImportError:
                message = "the playwright package is missing"
                if os.environ.get("MLXD_REQUIRE_BROWSER") == "1":
                    pytest.fail(message)
                pytest.skip(message)
            self._playwright = sync_playwright().start()
            try:
                self._browser = self._playwright.chromium.launch(
                    executable_path=path, args=CHROMIUM_ARGS
                )
            except BaseException:
                self.close()
                raise
            self.launches += 1
        return self._browser

    def close(self) -> None:
        browser, playwright = self._browser, self._playwright
        self._browser = self._playwright = None
        try:
            if browser is not None:
                browser.close()
        finally:
            if playwright is not None:
                playwright.stop()


_CHROMIUM = pytest.StashKey[Chromium]()


def _chromium(config: pytest.Config) -> Chromium:
    if _CHROMIUM not in config.stash:
        config.stash[_CHROMIUM] = Chromium()
    return config.stash[_CHROMIUM]


def _uses_browser(item: pytest.Item) -> bool:
    return "browser" in getattr(item, "fixturenames", ())


def pytest_collection_finish(session: pytest.Session) -> None:
    """Check the ``browser`` marker against the fixture."""
    wrong = [
        i.nodeid
        for i in session.items
        if _uses_browser(i) != (i.get_closest_marker("browser") is not None)
    ]
    if wrong:
        raise pytest.UsageError(
            "a test uses the browser (or pages) fixture exactly when it is marked "
            f"@pytest.mark.browser; these are not: {', '.join(wrong)}"
        )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    try:
        return (yield)
    finally:
        # After each run of browser tests (their pages are closed by now): the next
        # test may call asyncio.run, which fails while Playwright's loop runs.
        if nextitem is None or not _uses_browser(nextitem):
            _chromium(item.config).close()


@pytest.fixture
def browser(request: pytest.FixtureRequest) -> Any:
    """The session's headless Chromium (a Playwright ``Browser``)."""
    return _chromium(request.config).get()


@pytest.fixture
def pages(browser: Any) -> Iterator[Callable[..., Any]]:
    """``pages(**context_options)``: a new page in its own context; closed after the test."""
    contexts: list[Any] = []

    def new_page(**context_options: Any) -> Any:
        context = browser.new_context(**context_options)
        contexts.append(context)
        return context.new_page()

    yield new_page
    for context in contexts:
        context.close()


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    chromium = config.stash.get(_CHROMIUM, None)
    if chromium is not None and chromium.launches:
        terminalreporter.write_line(f"browser: Chromium launched {chromium.launches} time(s)")


# The htmx regions that poll (``hx-trigger="every …"``) replace themselves
# (``outerHTML``) while a test reads them: two reads (a count, then a style; or
# Playwright's ``locator.evaluate``, which finds the element and evaluates on it in
# two round trips) may see two versions, or an element already detached. While
# frozen, a polled region neither sends its request nor swaps in an answer already
# on its way; forms and buttons (``hx-post``) still work.
_FREEZE = """() => {
  if (!window.__mlxdFrozen) {
    window.__mlxdFrozen = {on: false};
    const polled = e => !!e && (e.getAttribute('hx-trigger') || '').trim().startsWith('every');
    document.addEventListener('htmx:beforeRequest', ev => {
      if (window.__mlxdFrozen.on && polled(ev.detail.elt)) ev.preventDefault();
    });
    document.addEventListener('htmx:beforeSwap', ev => {
      if (window.__mlxdFrozen.on && polled(ev.detail.elt)) {
        ev.detail.shouldSwap = false;
        ev.preventDefault();
      }
    });
  }
  window.__mlxdFrozen.on = true;
}"""
_THAW = "() => { if (window.__mlxdFrozen) window.__mlxdFrozen.on = false; }"


@contextmanager
def frozen(page: Any) -> Iterator[Any]:
    """Hold the page's polled regions still while the block reads them (then poll again)."""
    page.evaluate(_FREEZE)
    try:
        yield page
    finally:
        if not page.is_closed():
            page.evaluate(_THAW)


def wait_for_swap(page: Any, selector: str, timeout: float = 20_000) -> None:
    """Wait until the element at ``selector`` has been replaced by a poll (a new element)."""
    query = f"document.querySelector({json.dumps(selector)})"
    page.evaluate(f"() => {{ {query}.__mlxdOld = true; }}")
    page.wait_for_function(
        f"() => {{ const e = {query}; return !!e && !e.__mlxdOld; }}", timeout=timeout
    )
