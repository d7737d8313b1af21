"""WebArena: web navigation in a real headless Chromium driven by Playwright, with WebArena's action
grammar and evaluators, against the real sites or a small local shop and forum. Arrives with the
open-world environments issue."""
