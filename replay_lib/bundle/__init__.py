"""Bundle I/O: the atomic writer (``writer``), the verifying reader (``reader``), capture-directory
resolution (``resolution``) and the checked file reads they share (``files``)."""

from .files import HASH_CHUNK, check_payload_name, parse_format_version, sha256_bytes, sha256_file
from .reader import BundleReader, config_knob_active
from .resolution import BundleSet, Resolved, check_anchor, open_bundle, resolve_bundle, resolve_capture
from .writer import BundleWriter, try_finalize_cohort

__all__ = [
    "HASH_CHUNK", "BundleReader", "BundleSet", "BundleWriter", "Resolved", "check_anchor", "check_payload_name",
    "config_knob_active", "open_bundle", "parse_format_version", "resolve_bundle", "resolve_capture",
    "sha256_bytes", "sha256_file", "try_finalize_cohort",
]
