"""The loss-side knobs of SPEC §4.2 as the kernels read them (:class:`LossKnobs`), their allowed values, and
the check of those values (:func:`check_knobs`). No torch here: the schema validates a bundle's config with
it, and ``inspect``/``validate`` never import torch."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

# kernels.kl.KL_TYPES (a test keeps the two equal; that module imports torch)
KL_TYPES = ("k1", "k2", "k3", "low_var_kl", "abs")

SUM_OF_SAMPLE_MEANS = "sum_of_sample_means"
# The mean over the step's micro-batches of each one's masked token mean (verl reports pg_clipfrac, ppo_kl and
# pg_clipfrac_lower so: verl/workers/utils/losses.py:120 AggregationType.MEAN over its micro-batches): needs
# each sample's ``micro_batch_id`` (index.json), not a count.
MICRO_BATCH_TOKEN_MEAN = "micro_batch_token_mean"
# The mean over the step's prompts of each prompt's masked token mean (SkyRL loss_reduction=prompt_mean,
# ppo_utils.py:1209-1218 @ a9564572): each sample's prompt from its ``group_index`` (index.json).
PROMPT_MEAN = "prompt_mean"
AGG_MODES = (SUM_OF_SAMPLE_MEANS, "seq_mean_token_mean", "token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm",
             "token_sum", MICRO_BATCH_TOKEN_MEAN, PROMPT_MEAN)
# The recorded counts each mode needs (RecomputeConfig field names).
AGG_COUNTS = {
    SUM_OF_SAMPLE_MEANS: (),
    "seq_mean_token_mean": ("loss_seq_count",),
    "token_mean": ("loss_token_count",),
    "seq_mean_token_sum": ("loss_seq_count",),
    "seq_mean_token_sum_norm": ("loss_seq_count", "loss_horizon"),
    "token_sum": (),
    MICRO_BATCH_TOKEN_MEAN: (),
    PROMPT_MEAN: (),
}
IMPORTANCE_LEVELS = ("token", "sequence")
IS_LEVELS = ("token", "sequence", "geometric")
IS_MODES = ("truncate", "mask")


# Each registered policy-loss family's parameter defaults (kernels.families.register fills it: the bundle room
# does not import the kernels).
FAMILY_DEFAULTS: dict = {}


@dataclass(frozen=True)
class LossKnobs:
    """The loss-side knobs of SPEC §4.2, resolved from a :class:`~replay_lib.bundle.schema.RecomputeConfig`
    (:meth:`of`): effective values only — a KL term with coefficient 0 is off, slime's ``use_tis`` is
    ``is_level="token", is_mode="truncate"`` with its clip bounds."""

    eps_clip: float = 0.2
    eps_clip_high: float = 0.2
    entropy_coef: float = 0.0
    eps_clip_c: Optional[float] = None
    log_ratio_clamp: Optional[float] = None
    importance_level: str = "token"
    kl_loss_coef: float = 0.0  # 0: no KL term in the loss
    kl_loss_type: str = "k1"
    kl_loss_input_clamp: Optional[float] = None
    kl_loss_output_clamp: Optional[float] = None
    kl_loss_ratio_weighted: bool = False  # the KL term × the policy ratio (TRL use_bias_correction_kl)
    is_level: Optional[str] = None
    is_mode: str = "truncate"
    is_low: Optional[float] = None
    is_high: Optional[float] = None
    is_log_clamp: Optional[float] = None
    loss_agg_mode: str = SUM_OF_SAMPLE_MEANS
    metric_agg_mode: str = SUM_OF_SAMPLE_MEANS
    kl_loss_agg_mode: Optional[str] = None  # None: loss_agg_mode (see kl_mode)
    entropy_agg_mode: Optional[str] = None  # None: loss_agg_mode (see entropy_mode)
    loss_token_count: Optional[int] = None
    loss_seq_count: Optional[int] = None
    loss_horizon: Optional[int] = None
    loss_scale: float = 1.0
    value_clip: Optional[float] = None
    # each sample's micro-batch (an index into the step's micro-batches, in order of first appearance), from
    # the samples' ``micro_batch_id``; None when a sample records none (micro_batch_token_mean then refuses)
    micro_batch: Optional[tuple[int, ...]] = None
    # the policy-loss family (kernels.families) and its recorded parameters, sorted by name (:meth:`param`)
    policy_loss: str = "ppo"
    policy_loss_params: tuple[tuple[str, object], ...] = ()
    # OPSM (None: off), TRL's entropy mask (1.0: off) and on-policy distillation (None: off): RecomputeConfig
    opsm_delta: Optional[float] = None
    opsm_anchor: str = "old"
    top_entropy_quantile: float = 1.0
    opd_placement: Optional[str] = None
    opd_kl_type: str = "k1"
    opd_coef: float = 1.0
    opd_clamp: Optional[float] = None
    # the 0/1 keep masks of an off-policy correction (bundle.is_keep.parse_is_keep), () for none
    is_keep: tuple = ()
    # each sample's prompt (an index, in order of first appearance) from the samples' group_index; None without
    prompt: Optional[tuple[int, ...]] = None
    # the ratio 1: the loss's old log-probs are the current ones (NeMo-RL force_on_policy_ratio)
    force_on_policy_ratio: bool = False
    # the KL term × exp(logp − rollout) before its output clamp, a non-finite weight 0 (NeMo-RL
    # use_on_policy_kl_approximation)
    kl_loss_rollout_weighted: bool = False
    # the KL term × exp(logp − sg(logp)) (value 1): its gradient adds the score function's (NeMo-RL), loss.grad only
    kl_loss_score_function: bool = False
    # opd_placement="advantage": subtracted from the GRPO returns ("returns") or from 0 ("zero")
    opd_base: str = "returns"
    # the format is_keep's divergence gates are evaluated in (the producer's declared compute, set by the stage
    # from the comparison policy: the gate is a decision the producer took in its own format); None: the replay's
    is_keep_format: Optional[str] = None
    # the importance weights' divisor (RecomputeConfig.is_batch_norm_factor under is_batch_normalize), None: off
    is_norm: Optional[float] = None

    @classmethod
    def of(cls, cfg, samples=None) -> "LossKnobs":
        use_kl = bool(getattr(cfg, "use_kl_loss", False)) and float(getattr(cfg, "kl_loss_coef", 0.0)) != 0.0
        is_level, is_mode = cfg.is_level, cfg.is_mode
        is_low, is_high = cfg.is_low, cfg.is_high
        if is_level is None and getattr(cfg, "use_tis", False):  # slime's names
            is_level, is_mode, is_low, is_high = "token", "truncate", cfg.tis_clip_low, cfg.tis_clip
        return cls(eps_clip=float(cfg.eps_clip), eps_clip_high=float(cfg.eps_clip_high),
                   entropy_coef=float(cfg.entropy_coef), eps_clip_c=cfg.eps_clip_c,
                   log_ratio_clamp=cfg.log_ratio_clamp, importance_level=cfg.importance_level,
                   kl_loss_coef=float(cfg.kl_loss_coef) if use_kl else 0.0, kl_loss_type=cfg.kl_loss_type,
                   kl_loss_input_clamp=cfg.kl_loss_input_clamp, kl_loss_output_clamp=cfg.kl_loss_output_clamp,
                   kl_loss_ratio_weighted=bool(getattr(cfg, "kl_loss_ratio_weighted", False)),
                   is_level=is_level, is_mode=is_mode, is_low=is_low, is_high=is_high,
                   is_log_clamp=cfg.is_log_clamp, loss_agg_mode=cfg.loss_agg_mode,
                   metric_agg_mode=cfg.metric_agg_mode or cfg.loss_agg_mode,
                   kl_loss_agg_mode=getattr(cfg, "kl_loss_agg_mode", None),
                   entropy_agg_mode=getattr(cfg, "entropy_agg_mode", None),
                   loss_token_count=cfg.loss_token_count, loss_seq_count=cfg.loss_seq_count,
                   loss_horizon=cfg.loss_horizon, loss_scale=float(cfg.loss_scale), value_clip=cfg.value_clip,
                   micro_batch=micro_batch_partition(samples),
                   policy_loss=str(getattr(cfg, "policy_loss", "ppo") or "ppo"),
                   policy_loss_params=tuple(sorted((getattr(cfg, "policy_loss_params", None) or {}).items())),
                   opsm_delta=_set(cfg, "opsm_delta", None), opsm_anchor=_set(cfg, "opsm_anchor", "old"),
                   top_entropy_quantile=_set(cfg, "top_entropy_quantile", 1.0),
                   opd_placement=_set(cfg, "opd_placement", None), opd_kl_type=_set(cfg, "opd_kl_type", "k1"),
                   opd_coef=_set(cfg, "opd_coef", 1.0), opd_clamp=_set(cfg, "opd_clamp", None),
                   is_keep=_is_keep(cfg), prompt=prompt_partition(samples),
                   force_on_policy_ratio=bool(_set(cfg, "force_on_policy_ratio", False)),
                   kl_loss_rollout_weighted=bool(_set(cfg, "kl_loss_rollout_weighted", False)),
                   kl_loss_score_function=bool(_set(cfg, "kl_loss_score_function", False)),
                   opd_base=_set(cfg, "opd_base", "returns"), is_norm=_is_norm(cfg))

    def param(self, name: str):
        """The family's parameter ``name``: the recorded value, else the family's default
        (:data:`FAMILY_DEFAULTS`, filled as each family registers); ``KeyError`` for a name it has not."""
        for key, value in self.policy_loss_params:
            if key == name:
                return value
        return FAMILY_DEFAULTS[self.policy_loss][name]

    @property
    def family(self) -> bool:
        """A policy-loss family other than the clipped surrogate (``ppo``)."""
        return self.policy_loss != "ppo"

    @property
    def opsm(self) -> bool:
        return self.opsm_delta is not None

    @property
    def entropy_mask(self) -> bool:
        return self.top_entropy_quantile < 1.0

    @property
    def opd_loss(self) -> bool:
        """On-policy distillation as a supervised loss term (the field ``opd_loss``)."""
        return self.opd_placement == "loss"

    @property
    def kl_mode(self) -> str:
        """The aggregation of the KL term of the loss (``kl_loss_agg_mode``, else ``loss_agg_mode``)."""
        return self.kl_loss_agg_mode or self.loss_agg_mode

    @property
    def entropy_mode(self) -> str:
        """The aggregation of the entropy term (``entropy_agg_mode``, else ``loss_agg_mode``)."""
        return self.entropy_agg_mode or self.loss_agg_mode

    @property
    def loss_modes(self) -> str:
        """``loss_agg_mode`` for a report, with the KL and entropy terms' own modes where they are set."""
        own = [f"{term} {mode}" for term, mode, on in (("kl_loss", self.kl_loss_agg_mode, self.kl_loss),
                                                       ("entropy", self.entropy_agg_mode, True))
               if on and mode not in (None, self.loss_agg_mode)]
        return ", ".join([self.loss_agg_mode, *own])

    @property
    def kl_loss(self) -> bool:
        return self.kl_loss_coef != 0.0

    @property
    def dual_clip(self) -> bool:
        return self.eps_clip_c is not None

    @property
    def sequence_ratio(self) -> bool:
        return self.importance_level == "sequence"

    @property
    def needs_sample_pass(self) -> bool:
        """A per-sample quantity (GSPO's ratio, a sequence or geometric IS weight) is needed before the
        per-token terms: one more pass over the tokens."""
        return self.sequence_ratio or self.is_level in ("sequence", "geometric") or self.is_keep_sample

    @property
    def is_keep_sample(self) -> bool:
        """A keep mask decided per sample (``outlier``, ``geometric``, ``product``)."""
        return any(kind != "token" for kind, _, _ in self.is_keep)

    def with_clips(self, eps_clip: float, eps_clip_high: float) -> "LossKnobs":
        return replace(self, eps_clip=eps_clip, eps_clip_high=eps_clip_high)


OPSM_ANCHORS = ("old", "rollout")
OPD_PLACEMENTS = ("advantage", "loss")
OPD_BASES = ("returns", "zero")


def _set(cfg, name: str, default):
    """``cfg.name`` unless unset (msgspec.UNSET, or absent from a stand-in config): then ``default``."""
    value = getattr(cfg, name, default)
    return default if type(value).__name__ == "UnsetType" else value


def _is_keep(cfg) -> tuple:
    value = getattr(cfg, "is_keep", None)
    if not isinstance(value, dict):
        return ()
    from .is_keep import parse_is_keep

    return parse_is_keep(value)


def micro_batch_partition(samples) -> Optional[tuple[int, ...]]:
    """Each sample's micro-batch as an index (in order of first appearance), ``None`` without samples or when
    one records no ``micro_batch_id``."""
    if not samples:
        return None
    ids = [s.micro_batch_id for s in samples]
    if any(i is None for i in ids):
        return None
    first: dict = {}
    return tuple(first.setdefault(i, len(first)) for i in ids)


def prompt_partition(samples) -> Optional[tuple[int, ...]]:
    """Each sample's prompt as an index (in order of first appearance of its ``group_index``), ``None`` without
    samples."""
    if not samples:
        return None
    first: dict = {}
    return tuple(first.setdefault(s.group_index, len(first)) for s in samples)


def uses_micro_batches(cfg) -> Optional[str]:
    """The first aggregation knob of ``cfg`` set to ``micro_batch_token_mean`` (it needs the partition), or None."""
    for knob in ("loss_agg_mode", "metric_agg_mode", "kl_loss_agg_mode", "entropy_agg_mode"):
        if getattr(cfg, knob, None) == MICRO_BATCH_TOKEN_MEAN:
            return knob
    return None


def _is_norm(cfg) -> Optional[float]:
    """The importance weights' recorded divisor when the config normalizes them (None: off, or not recorded:
    loss.policy then names it as missing)."""
    if getattr(cfg, "is_batch_normalize", False) is not True:
        return None
    factor = getattr(cfg, "is_batch_norm_factor", None)
    return float(factor) if isinstance(factor, (int, float)) and not isinstance(factor, bool) else None


def check_knobs(knobs: LossKnobs) -> list[str]:
    """What is wrong with the knobs' values (one message each; ``[]``: valid): an unknown mode or type,
    ``eps_clip_c ≤ 1``, a non-positive clamp. The schema reports these as one-line errors (exit 3)."""
    errors = []
    for name, value, allowed in (("loss_agg_mode", knobs.loss_agg_mode, AGG_MODES),
                                 ("metric_agg_mode", knobs.metric_agg_mode, AGG_MODES),
                                 ("importance_level", knobs.importance_level, IMPORTANCE_LEVELS),
                                 ("is_mode", knobs.is_mode, IS_MODES), ("kl_loss_type", knobs.kl_loss_type, KL_TYPES)):
        if value not in allowed:
            errors.append(f"{name}: expected one of {', '.join(allowed)}, got {value!r}")
    for name in ("kl_loss_agg_mode", "entropy_agg_mode"):
        value = getattr(knobs, name)
        if value is not None and value not in AGG_MODES:
            errors.append(f"{name}: expected null or one of {', '.join(AGG_MODES)}, got {value!r}")
    if knobs.is_level is not None and knobs.is_level not in IS_LEVELS:
        errors.append(f"is_level: expected null or one of {', '.join(IS_LEVELS)}, got {knobs.is_level!r}")
    if knobs.eps_clip_c is not None and not (math.isfinite(knobs.eps_clip_c) and knobs.eps_clip_c > 1.0):
        errors.append(f"eps_clip_c: dual-clip needs c > 1, got {knobs.eps_clip_c!r}")
    for name in ("log_ratio_clamp", "kl_loss_input_clamp", "kl_loss_output_clamp", "is_log_clamp", "value_clip"):
        value = getattr(knobs, name)
        if value is not None and not value > 0:
            errors.append(f"{name}: expected null or a value > 0, got {value!r}")
    if knobs.is_low is not None and knobs.is_high is not None and knobs.is_low > knobs.is_high:
        errors.append(f"is_low: {knobs.is_low!r} is above is_high {knobs.is_high!r}")
    for name, value in knobs.policy_loss_params:
        if isinstance(value, float) and not math.isfinite(value):
            errors.append(f"policy_loss_params.{name}: expected a finite value, got {value!r}")
    if knobs.opsm_delta is not None and not math.isfinite(knobs.opsm_delta):
        errors.append(f"opsm_delta: expected a finite threshold, got {knobs.opsm_delta!r}")
    if knobs.opsm_anchor not in OPSM_ANCHORS:
        errors.append(f"opsm_anchor: expected one of {', '.join(OPSM_ANCHORS)}, got {knobs.opsm_anchor!r}")
    if not 0.0 < knobs.top_entropy_quantile <= 1.0:
        errors.append(f"top_entropy_quantile: expected a value in (0, 1], got {knobs.top_entropy_quantile!r}")
    if knobs.opd_placement is not None and knobs.opd_placement not in OPD_PLACEMENTS:
        errors.append(f"opd_placement: expected null or one of {', '.join(OPD_PLACEMENTS)}, "
                      f"got {knobs.opd_placement!r}")
    if knobs.opd_kl_type not in KL_TYPES:
        errors.append(f"opd_kl_type: expected one of {', '.join(KL_TYPES)}, got {knobs.opd_kl_type!r}")
    if not math.isfinite(knobs.opd_coef):
        errors.append(f"opd_coef: expected a finite coefficient, got {knobs.opd_coef!r}")
    if knobs.opd_clamp is not None and not (math.isfinite(knobs.opd_clamp) and knobs.opd_clamp > 0):
        errors.append(f"opd_clamp: expected null or a finite value > 0, got {knobs.opd_clamp!r}")
    if knobs.opd_base not in OPD_BASES:
        errors.append(f"opd_base: expected one of {', '.join(OPD_BASES)}, got {knobs.opd_base!r}")
    if knobs.kl_loss_rollout_weighted and knobs.kl_loss_ratio_weighted:
        errors.append("kl_loss_rollout_weighted: expected kl_loss_ratio_weighted false with it (one KL weight)")
    if knobs.kl_loss_score_function and (knobs.kl_loss_ratio_weighted or knobs.kl_loss_rollout_weighted):
        errors.append("kl_loss_score_function: expected kl_loss_ratio_weighted and kl_loss_rollout_weighted false "
                      "with it (one KL weight)")
    if not math.isfinite(knobs.loss_scale):
        errors.append(f"loss_scale: expected a finite multiplier, got {knobs.loss_scale!r}")
    return errors
