"""Textual debugger for replay bundles. ``replay-tui BUNDLE --check`` runs headless (no Textual import)."""
