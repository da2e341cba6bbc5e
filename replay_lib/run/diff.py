"""``trajectory-replay diff A B``: two captures of the same step compared field by field (SPEC §9).

Both bundles are opened and verified (exit 3 on a problem). They must hold the same sample ids with the
same response lengths — else one line names the first difference, exit 3: a diff of different batches
would be all noise. Samples are matched by id (the order may differ: rank 0 vs rank 1, a reordered
loader); tokens by their offset in the sample's response.

Compared, A as expected and B as actual, each field judged with the error model's
:func:`~replay_lib.judge.fields.compare_field` (NaN/Inf always differ; otherwise ``|b − a| > atol + rtol·|a|``
with A's declared tolerance of the stage that produces the field, plus one rounding ``u·|a|`` of the
coarser dtype when the two payloads' dtypes differ):

* the per-sample records of ``index.json``: ``raw_reward``, ``reward``, ``loss_mask`` (per token);
* every payload both bundles hold (per token when it has one row per response token, else element by
  element, a shape difference being a length mismatch);
* every number of ``expected.json`` both hold: per-sample lists, the ``per_sample`` loss terms, scalars.

The report has the shape of a replay report (one "stage" per field, its first differences, exit 1 when a
field differs); a field held by one bundle only is listed as skipped.
"""

from __future__ import annotations

import math


import msgspec
import torch

from ..bundle import BundleSet, open_bundle
from ..bundle.dtypes import keep_stored, stored_dtype
from ..judge.compare import as_float64
from ..judge.error_model import bundle_tolerance, unit_roundoff
from ..errors import BundleError
from ..judge.fields import PER_SAMPLE, PER_SCALAR, PER_TOKEN, FieldResult, stage_report
from ..kernels import segment_offsets
from ..judge.report import STATUS_FAIL, STATUS_SKIPPED, ReplayReport, StageReport

# The stage whose output a payload is (its declared tolerance applies); others use the defaults.
PAYLOAD_STAGE = {"advantages": "advantage.estimate", "returns": "advantage.estimate", "kl": "advantage.kl",
                 "rewards": "reward.post_process", "log_probs": "loss.policy", "old_log_probs": "loss.policy",
                 "ref_log_probs": "advantage.kl", "entropy": "loss.policy", "pg_losses": "loss.policy",
                 "grad_log_probs": "loss.grad", "grad_values": "loss.grad",
                 "rollout_log_probs": "logprob.mismatch", "policy_versions": "logprob.mismatch",
                 "teacher_log_probs": "loss.policy", "clip_cov_mask": "loss.policy"}
INDEX_FIELDS = (("raw_reward", "reward.raw"), ("reward", "reward.post_process"))


def _token_rewards(side: "_Side") -> torch.Tensor:
    """float64 ``[tokens]`` of a side's rewards: a per-token list as it is, a number on each of its sample's
    tokens, ``None`` as NaN."""
    parts = []
    for s, n in zip(side.samples, side.lengths.tolist()):
        r = s.reward
        parts.append(torch.tensor(r[:n], dtype=torch.float64) if type(r) is list
                     else torch.full((n,), math.nan if r is None else float(r), dtype=torch.float64))
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.float64)


class _Side:
    """One bundle flattened over its rank shards: samples in shard order, each one's token slice."""

    def __init__(self, bundles: BundleSet, name: str) -> None:
        self.bundles, self.name = bundles, name
        self.samples = [s for shard in bundles.shards for s in shard.index.samples]
        # each sample's loss mask, read on demand (a format-1.3 bundle keeps them packed: BundleReader.sample_mask)
        self.masks = [(shard, i) for shard in bundles.shards for i in range(len(shard.index.samples))]
        self.lengths = torch.tensor([max(int(s.response_length), 0) for s in self.samples], dtype=torch.int64)
        self.offsets = segment_offsets(self.lengths)
        self.total = int(self.lengths.sum())
        self.position = {s.sample_id: i for i, s in enumerate(self.samples)}
        self.policy = bundles.shards[0].manifest.comparison_policy
        names = [set(shard.payload_names) for shard in bundles.shards]
        self.payload_names = set.intersection(*names) if names else set()

    def payload(self, name: str) -> torch.Tensor:
        parts = [shard.payload(name) for shard in self.bundles.shards]
        return keep_stored(parts[0].reshape(-1) if len(parts) == 1 else torch.cat([p.reshape(-1) for p in parts]),
                           parts[0])

    def expected(self) -> dict:
        """expected.json of every shard, lists concatenated in shard order (scalars: the first shard's)."""
        out: dict = {}
        for shard in self.bundles.shards:
            for stage, values in shard.expected.items():
                for key, value in values.items():
                    if isinstance(value, msgspec.Struct):  # the per_sample loss terms: the ones recorded
                        value = {k: v for k, v in msgspec.structs.asdict(value).items() if v is not None}
                    if isinstance(value, dict):
                        for sub, v in value.items():
                            _add(out, stage, f"{key}.{sub}", v)
                    else:
                        _add(out, stage, key, value)
        return out


def _add(out: dict, stage: str, key: str, value) -> None:
    slot = (stage, key)
    if isinstance(value, list):
        out.setdefault(slot, []).extend(value)
    elif isinstance(value, (int, float)) and not isinstance(value, bool) or value is None:
        out.setdefault(slot, value)


def check_same_samples(a: _Side, b: _Side) -> None:
    """Same sample ids, same response lengths; else the one-line error (exit 3)."""
    where = f"{a.name} vs {b.name}"
    if len(a.samples) != len(b.samples):
        raise BundleError(f"{where}: different sizes: {len(a.samples)} sample(s) vs {len(b.samples)}; diff compares "
                          f"two captures of the same step")
    only_a = [s.sample_id for s in a.samples if s.sample_id not in b.position]
    if only_a or len(a.position) != len(b.position):
        other = [s.sample_id for s in b.samples if s.sample_id not in a.position]
        first = f"{only_a[0]!r} only in A" if only_a else f"{other[0]!r} only in B" if other else "duplicate ids"
        raise BundleError(f"{where}: different sample ids ({first}); diff compares two captures of the same step")
    for i, s in enumerate(a.samples):
        j = b.position[s.sample_id]
        if int(a.lengths[i]) != int(b.lengths[j]):
            raise BundleError(f"{where}: sample {s.sample_id!r}: response_length {int(a.lengths[i])} vs "
                              f"{int(b.lengths[j])}; diff compares two captures of the same step")


class _Differ:
    def __init__(self, a: _Side, b: _Side, keep: int) -> None:
        self.a, self.b, self.keep = a, b, keep
        order = torch.tensor([b.position[s.sample_id] for s in a.samples], dtype=torch.int64)
        self.sample_order = order  # B's sample index of each of A's samples
        # B's token index of each of A's tokens
        seg = torch.repeat_interleave(torch.arange(len(a.samples)), a.lengths)
        self.token_order = b.offsets[order][seg] + (torch.arange(a.total) - a.offsets[seg])
        self.ids = [s.sample_id for s in a.samples]
        self.groups = [s.group_index for s in a.samples]

    def field(self, name: str, stage: str, per: str, expected, actual, coarse: float = 0.0) -> StageReport:
        e, x = as_float64(expected), as_float64(actual)
        atol, rtol = bundle_tolerance(self.a.policy, stage, name.rpartition(".")[2])
        tolerance = atol + (rtol + coarse) * torch.nan_to_num(e.abs(), nan=0.0, posinf=0.0)
        f = FieldResult(stage=name, name=name, per=per, expected=e, actual=x, tolerance=tolerance,
                        sample_ids=self.ids, group_indices=self.groups, offsets=self.a.offsets,
                        lengths=self.a.lengths, note=f"expected: {self.a.name}; actual: {self.b.name}")

        def differ(total, per_field) -> str:
            return f"{total.mismatches} of {total.compared} value(s) differ (max abs_err {total.max_abs_error:.3g})" \
                if total.max_abs_error is not None and total.max_abs_error == total.max_abs_error \
                else f"{total.mismatches} of {total.compared} value(s) differ"

        return stage_report(name, [f], self.keep, fail_reason=differ,
                            pass_reason=lambda total, per_field: f"{total.compared} value(s) equal within tolerance")

    def aligned(self, values: torch.Tensor, per: str) -> torch.Tensor:
        if per == PER_TOKEN:
            return values[self.token_order]
        if per == PER_SAMPLE:
            return values[self.sample_order]
        return values

    def reports(self) -> list[StageReport]:
        a, b = self.a, self.b
        out = []
        for name, stage in INDEX_FIELDS:
            if name == "reward" and any(type(s.reward) is list for s in (*a.samples, *b.samples)):
                # per-token rewards (format 1.2 / 2.0) on either side: compared token by token, a number broadcast
                ta, tb = _token_rewards(a), _token_rewards(b)
                out.append(self.field(name, stage, PER_TOKEN, ta, self.aligned(tb, PER_TOKEN)))
                continue
            ea = [getattr(s, name) for s in a.samples]
            eb = as_float64([getattr(s, name) for s in b.samples])
            if all(v is None for v in ea) and bool(torch.isnan(eb).all()):
                continue
            out.append(self.field(name, stage, PER_SAMPLE, ea, self.aligned(eb, PER_SAMPLE)))
        mask_a = torch.cat([torch.tensor(shard.sample_mask(i)[:n], dtype=torch.float64)
                            for (shard, i), n in zip(a.masks, a.lengths.tolist())]) if a.samples else torch.empty(0)
        mask_b = torch.cat([torch.tensor(shard.sample_mask(i)[:n], dtype=torch.float64)
                            for (shard, i), n in zip(b.masks, b.lengths.tolist())]) if b.samples else torch.empty(0)
        if mask_a.numel() == a.total and mask_b.numel() == b.total:
            out.append(self.field("loss_mask", "", PER_TOKEN, mask_a, self.aligned(mask_b, PER_TOKEN)))
        for name in sorted(a.payload_names | b.payload_names):
            if name not in a.payload_names or name not in b.payload_names:
                out.append(_only(name, a.name if name in a.payload_names else b.name))
                continue
            pa, pb = a.payload(name), b.payload(name)
            if not (pa.is_floating_point() or pb.is_floating_point()) and pa.dtype == torch.bool:
                pa, pb = pa.to(torch.int64), pb.to(torch.int64)
            coarse = max(unit_roundoff(pa), unit_roundoff(pb)) if stored_dtype(pa) != stored_dtype(pb) else 0.0
            per = PER_TOKEN if pa.numel() == a.total and pb.numel() == b.total and a.total else PER_SCALAR
            out.append(self.field(name, PAYLOAD_STAGE.get(name, ""), per, pa, self.aligned(pb, per), coarse))
        ea, eb = a.expected(), b.expected()
        for slot in sorted(set(ea) | set(eb)):
            stage, key = slot
            name = f"expected.{stage}.{key}"
            if slot not in ea or slot not in eb:
                out.append(_only(name, a.name if slot in ea else b.name))
                continue
            va, vb = ea[slot], eb[slot]
            if isinstance(va, list) and isinstance(vb, list) and len(va) == len(vb) == len(a.samples):
                out.append(self.field(name, stage, PER_SAMPLE, va, self.aligned(as_float64(vb), PER_SAMPLE)))
            else:
                va, vb = va if isinstance(va, list) else [va], vb if isinstance(vb, list) else [vb]
                out.append(self.field(name, stage, PER_SCALAR, va, vb))
        return out


def _only(name: str, holder: str) -> StageReport:
    return StageReport(stage=name, status=STATUS_SKIPPED, reason=f"only in {holder}")


def diff_bundles(path_a, path_b, *, max_divergences: int = 5) -> ReplayReport:
    """The field-by-field report of B against A (see the module docstring); BundleError (exit 3) when
    they are not two captures of the same samples."""
    a = _Side(open_bundle(path_a), "A")
    b = _Side(open_bundle(path_b), "B")
    a.name, b.name = f"A {a.bundles.bundle_id} ({path_a})", f"B {b.bundles.bundle_id} ({path_b})"
    check_same_samples(a, b)
    stages = _Differ(a, b, max(int(max_divergences), 1)).reports()
    first = next((s for s in stages if s.status == STATUS_FAIL), None)
    ident_a = a.bundles.shards[0].index.identity
    ident_b = b.bundles.shards[0].index.identity
    warnings = []
    if ident_a.anchor != ident_b.anchor:
        warnings.append(f"the two bundles have different anchors: A {ident_a.anchor}, B {ident_b.anchor}")
    # two captures of one step usually share its id: then the paths tell A from B
    title = f"{a.bundles.bundle_id} vs {b.bundles.bundle_id}" if a.bundles.bundle_id != b.bundles.bundle_id else \
        f"{a.bundles.bundle_id} (A {path_a} vs B {path_b})"
    return ReplayReport(bundle_id=title, passed=first is None,
                        first_divergent_stage=first.stage if first else None,
                        first_divergence=first.divergences[0] if first and first.divergences else None,
                        stages=stages, kind=ident_a.kind, anchor=ident_a.anchor, mode="diff", warnings=warnings)
