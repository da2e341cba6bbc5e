"""The debugger's model: what the panes render, built from a verified :class:`BundleSet` and the runner's
:class:`ReplayReport`. Pure data (torch + replay_lib only, no Textual), unit-tested without an App.

The report says *which* stage failed and keeps a few divergences; the panes also need every element of
the viewed field (the token diff, the per-sample mismatch marks). Those are the stages' own
:class:`~replay_lib.judge.fields.FieldResult` objects: the model runs a stage adapter on a full
:class:`StageContext` (lazily, or reuses the replay's context) and reads ``ctx.fields`` — expected, actual,
tolerance and the bad mask exactly as the report judged them. It never re-derives a stage's values.

The model is split by what each view shows: ``fields`` (what can be viewed), ``replay_model`` (the model the app
holds), ``recompute`` (a shard's stages re-run for the views), ``token_diff`` (the diff view), ``sample_table`` (the
sample tree), ``support_rows`` (the support strip), ``identity`` (the identity pane), ``verdict`` (the status bar).
"""

from .fields import KIND_SAMPLE, TREE_GROUP, TREE_SAMPLE, KIND_TOKEN, KIND_COHORT, SUPPORT_STAGE, FieldSpec, FIELDS, FIELD_BY_NAME, FIELD_BY_STAGE, SUPPORT_SOURCE, LOSS_TERM_FIELDS, DERIVED_FIELDS, field_for_divergence, cohort_result
from .token_diff import FieldDiff, token_rows, token_diff
from .recompute import ShardRecompute, rules_of, stages_that_ran, recompute_shard
from .support_rows import SupportRow, _row_issue_text, support_row
from .sample_table import SampleRow, _NO_MISMATCH, SampleRows, GroupRow, GROUP_SCANS, TreeRows, group_rows
from .replay_model import ReplayModel, build_model, _build_model
from .identity import _cohort_ids, identity_lines
from .verdict import first_divergence_text, explanation_text, fmt_cell

__all__ = ["DERIVED_FIELDS", "FIELDS", "FIELD_BY_NAME", "FIELD_BY_STAGE", "FieldDiff", "FieldSpec", "GROUP_SCANS", "GroupRow", "KIND_COHORT", "KIND_SAMPLE", "KIND_TOKEN", "LOSS_TERM_FIELDS", "ReplayModel", "SUPPORT_SOURCE", "SUPPORT_STAGE", "SampleRow", "SampleRows", "ShardRecompute", "SupportRow", "TREE_GROUP", "TREE_SAMPLE", "TreeRows", "build_model", "cohort_result", "explanation_text", "field_for_divergence", "first_divergence_text", "fmt_cell", "group_rows", "identity_lines", "recompute_shard", "rules_of", "stages_that_ran", "support_row", "token_diff", "token_rows"]
