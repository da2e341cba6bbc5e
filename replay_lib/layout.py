"""The on-disk layout of a bundle, cohort and capture directory: names only (no torch), shared by the
verifying reader and the tolerant ``inspect``."""

from __future__ import annotations

import re

METADATA_FILES = ("manifest.json", "index.json", "expected.json")
PAYLOAD_DIR = "payloads"
PAYLOAD_SUFFIX = ".pt"
_PAYLOAD_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_RANK_DIR = re.compile(r"^rank-(\d+)$")
_RANK_SENTINEL = re.compile(r"^COMPLETE\.(\d+)$")
