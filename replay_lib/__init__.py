"""Trajectory Replay: verifiable offline replay of one asynchronous RL post-training step.

Headless: importing this package never imports Textual.
"""

__version__ = "0.1.0"
