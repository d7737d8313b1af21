"""WebArena: a real headless Chromium (Playwright, Debian's chromium) on WebArena-format tasks, with the
shipped shop and forum for offline use (``backend``, ``browser``, ``evaluators``, ``site``, ``client``,
``expert``)."""
