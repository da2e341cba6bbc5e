"""Whole runs (SPEC §9): scan a capture directory (``scan``), in worker processes or Ray tasks
(``executor``), the cross-bundle stage ``link`` (``link``) and bundle-vs-bundle comparison (``diff``).

Headless: nothing here imports Textual; the run view of ``replay-tui DIR`` calls :func:`scan.scan`."""
