"""msgspec schema of a replay bundle (format 1.x).

The names follow the original design document (``ActorStepId``, ``BundleIndex`` …). Every field a reader
needs is written explicitly: msgspec encodes defaults too, so a bundle never relies on a reader's default.
Fields added by this implementation are optional with defaults, so bundles written by the original
format 1.0.0 writer decode here, and ours decode there.
"""

from __future__ import annotations

import enum
import functools
import json
import math
from typing import Annotated, Any, Literal, Optional, Union

import msgspec
from msgspec.structs import force_setattr

# What every writer of a new bundle writes (capture, the importers, the demo and synthetic bundles): format 1.3.0, the
# samples' masks packed into a payload and every payload a safetensors file (bundle.packed). A manifest may name an
# older minor and the writer writes that one's form: UNPACKED_FORMAT_VERSION (the masks in index.json, .pt payloads)
# for a bundle of the older form; ``convert`` goes between any two of 1.0.0, 1.1.0, 1.2.0, 1.3.0 and the original's
# 2.0.0 in one step.
FORMAT_VERSION = "1.3.0"
WRITE_FORMAT_VERSION = FORMAT_VERSION
UNPACKED_FORMAT_VERSION = "1.1.0"  # the last minor with per-token JSON masks and torch.save (.pt) payloads
SUPPORTED_MAJOR = 1
# Format 1.2.0 (a backward-compatible minor): a sample's ``reward`` may be a per-token list. The writer declares it
# only for a bundle that holds one, so every other bundle is written byte for byte as before.
PER_TOKEN_REWARD_VERSION = "1.2.0"
# The original tool's format 2.0.0 (Relax ``relax/utils/replay/schema.py`` @ 78973a59): the reward stages, a
# sample's ``raw_reward``, the config's ``n_samples_per_prompt`` / ``grpo_std_normalization`` and the identity's
# ``normalization_cohort_ids`` removed; a sample's ``reward`` (the post-processed reward that advantage estimation
# consumes, scalar or per token) required. This reader reads both majors; the writer writes either.
FORMAT_2_VERSION = "2.0.0"
SUPPORTED_MAJORS = (1, 2)
# The stages of format 2.0 (its StageId enum), and the 1.x stages it removed.
FORMAT_2_STAGE_IDS = frozenset({"sample", "advantage.kl", "advantage.estimate", "loss.policy", "loss.value"})
FORMAT_2_REMOVED_STAGES = ("reward.raw", "reward.post_process")
# What a 2.0 bundle does not hold, by its 1.x name (``inspect`` shows none of them as recorded).
FORMAT_2_REMOVED_CONFIG = ("n_samples_per_prompt", "grpo_std_normalization")
FORMAT_2_REMOVED_IDENTITY = ("normalization_cohort_ids",)
FORMAT_2_REMOVED_SAMPLE = ("raw_reward",)
NOT_IN_FORMAT_2 = "not in format 2.0"


def format_major(version) -> Optional[int]:
    """The major number of a ``MAJOR.MINOR.PATCH`` version, else ``None``."""
    if isinstance(version, str):
        head = version.split(".", 1)[0]
        if head.isascii() and head.isdigit() and len(head) <= 9:
            return int(head)
    return None

# Every integer a bundle holds is bounded (SPEC §11): an int64, as the tensors and kernels that consume it
# are. A value outside is a one-line schema error naming its field, not an OverflowError in a stage.
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
Int = Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)]
Count = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]  # a size, a dimension, a rank number
WorldSize = Annotated[int, msgspec.Meta(ge=1, le=INT64_MAX)]  # a parallel axis has at least one rank

# An identifier (a sample, micro-batch, bundle or partition id, a commit): at most this many characters. Every view
# shows ids whole, and one of megabytes made the debugger unusable; real ids are a few dozen characters.
ID_MAX_CHARS = 1024
Id = Annotated[str, msgspec.Meta(max_length=ID_MAX_CHARS)]
# A sample is named in every view and selected by name (--sample): never the empty string.
SampleId = Annotated[str, msgspec.Meta(min_length=1, max_length=ID_MAX_CHARS)]
Scalar = Union[Int, Id]


class StageId(str, enum.Enum):
    SAMPLE = "sample"
    REWARD_RAW = "reward.raw"
    REWARD_POST_PROCESS = "reward.post_process"
    ADVANTAGE_KL = "advantage.kl"
    ADVANTAGE_ESTIMATE = "advantage.estimate"
    LOGPROB_SUPPORT = "logprob.support"
    LOGPROB_MISMATCH = "logprob.mismatch"
    LOSS_POLICY = "loss.policy"
    LOSS_VALUE = "loss.value"
    LOSS_GRAD = "loss.grad"

    def __str__(self) -> str:  # "reward.raw", not "StageId.REWARD_RAW"
        return self.value


# The stage ids of the original tool's format 1.0.0. Its reader parses every key of
# ``manifest.stage_contracts`` as this enum and refuses any other, so a contract for one of our extension
# stages is written to ``extension_stage_contracts`` instead, a field it ignores (see ``Manifest``).
ORIGINAL_STAGE_IDS = frozenset({"sample", "reward.raw", "reward.post_process", "advantage.kl",
                                "advantage.estimate", "loss.policy", "loss.value"})
# The ones among them its engine recomputes (it declares ``loss.value`` unsupported, always).
ORIGINAL_RECOMPUTED_STAGE_IDS = ORIGINAL_STAGE_IDS - {"loss.value"}


class StageCapability(str, enum.Enum):
    RECOMPUTE = "recompute"
    RECORDED_ONLY = "recorded-only"
    INSPECT_ONLY = "inspect-only"
    UNSUPPORTED = "unsupported"

    def __str__(self) -> str:
        return self.value


class _Struct(msgspec.Struct, frozen=True, kw_only=True):
    pass


class ActorStepId(_Struct, kw_only=True, forbid_unknown_fields=True):
    """The train_one_step coordinate: (rollout_id, step_id). A flat step number is never persisted."""

    rollout_id: Int
    step_id: Int

    def __str__(self) -> str:
        return f"{self.rollout_id}:{self.step_id}"


class WeightLineage(_Struct, kw_only=True, forbid_unknown_fields=True):
    rollout_weight: Optional[Scalar] = None
    actor_weight: Optional[Scalar] = None


RANK_AXES = ("dp", "tp", "pp", "cp")


class Identity(_Struct, kw_only=True, forbid_unknown_fields=True):
    """Logical identity (sample, semantic group, cohort, actor step) and physical provenance."""

    actor_step_id: Optional[ActorStepId] = None
    rollout_id: Optional[Int] = None
    rollout_partition_ids: list[Scalar] = []
    consumer_batch_ids: list[Scalar] = []
    micro_batch_ids: list[Scalar] = []
    semantic_group_ids: list[Scalar] = []
    normalization_cohort_ids: list[Scalar] = []
    weight_lineage: WeightLineage = WeightLineage()
    # World sizes per parallel axis. Accepts a partial mapping (``{"cp": 1}``) and writes all four axes.
    rank: dict[str, WorldSize] = {}

    def __post_init__(self) -> None:
        full = {axis: 1 for axis in RANK_AXES}
        full.update(self.rank)
        force_setattr(self, "rank", full)

    @property
    def kind(self) -> str:
        """``step`` for a bundle anchored by an actor step, ``rollout`` for a rollout-level bundle."""
        return "step" if self.actor_step_id is not None else "rollout"

    @property
    def anchor(self) -> str:
        if self.actor_step_id is not None:
            return f"actor_step_id={self.actor_step_id}"
        return f"rollout_id={self.rollout_id}"


# gc=False: a step holds thousands of records, and a record (strings, numbers, a list of ints) can never be
# part of a reference cycle, so the collector need not track or walk them. The fields are declared in the order
# the wire writes the keys (sorted, SPEC §2.1): the decoder then finds each key's field at its first guess
# (≈ 6 % of decoding a 4,096-sample index). Keyword-only: the order means nothing else.
class SampleRecord(_Struct, kw_only=True, forbid_unknown_fields=True, gc=False):
    # SPEC §3: the consumer (transfer) batch that delivered the sample, when the producer records it; left out of
    # the JSON when not recorded (UNSET), so a bundle without it is written byte for byte as before.
    consumer_batch_id: Union[Id, None, msgspec.UnsetType] = msgspec.UNSET
    group_index: Optional[Int] = None
    # Redacted text fields (label, prompt, response, tool_output) are written only as the manifest's redaction
    # policy says; ``None`` = dropped.
    label: Optional[str] = None
    label_hash: Optional[str] = None
    # Format 1.3 (SPEC §2.3) packs the masks into the payload ``loss_mask``: unset here, not written. Before 1.3
    # every sample has it (the reader refuses a record without it).
    loss_mask: Union[list[Int], msgspec.UnsetType] = msgspec.UNSET
    micro_batch_id: Optional[Id] = None
    prompt: Optional[str] = None
    raw_reward: Optional[float] = None
    response: Optional[str] = None
    response_length: Int
    # The post-processed reward advantage estimation consumes: one per sample, or (format 1.2 / 2.0) a list of
    # ``response_length`` per-token values.
    reward: Union[float, list[float], None] = None
    sample_id: SampleId
    tool_output: Optional[str] = None
    total_length: Int
    # SPEC §4.2, estimators with per-sample inputs beyond the score (optional, a minor addition: unset, they are not
    # written, so a bundle without them is byte-identical to one written before them). reward_baseline: the
    # reward of the prompt's greedy rollout that ReMax subtracts (verl ``reward_baselines``); reward_components:
    # the sample's reward components in one order for every sample (GDPO normalizes each apart).
    reward_baseline: Union[float, msgspec.UnsetType] = msgspec.UNSET
    reward_components: Union[list[float], msgspec.UnsetType] = msgspec.UNSET
    # Whether the generation stopped at the token limit (finish_reason "length"), for the stop-properly penalty
    # (RecomputeConfig.truncated_reward_coef). Unset: not written.
    truncated: Union[bool, msgspec.UnsetType] = msgspec.UNSET


class AdvantageWhitenStats(_Struct, kw_only=True, forbid_unknown_fields=True):
    """The producer's global whitening statistics over its whole batch (a bundle may hold one shard)."""

    mean: float
    std: float


class RecomputeConfig(_Struct, kw_only=True, forbid_unknown_fields=True):
    """Every knob that changes the math, including the ones V1 cannot recompute (so they can be refused)."""

    advantage_estimator: str = "grpo"
    n_samples_per_prompt: Int = 1
    grpo_std_normalization: bool = False
    kl_loss_type: str = "k1"
    kl_coef: float = 0.0
    eps_clip: float = 0.2
    eps_clip_high: float = 0.2
    entropy_coef: float = 0.0
    # Knobs V1 does not implement; a replay refuses them by name when set.
    rewards_normalization: bool = True
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    use_tis: bool = False
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    calculate_per_token_loss: bool = False
    normalize_advantages: bool = False
    eps_clip_c: Optional[float] = None
    use_rollout_logprobs: bool = False
    # SPEC §4.2, loss side (loss.policy, loss.value). Defaults are V1's semantics.
    # loss_agg_mode: sum_of_sample_means | seq_mean_token_mean | token_mean | seq_mean_token_sum |
    # seq_mean_token_sum_norm; the recorded all-reduced counts T, N, L and the producer's multiplier.
    loss_agg_mode: str = "sum_of_sample_means"
    metric_agg_mode: Optional[str] = None  # None = loss_agg_mode
    # The KL-loss and entropy terms' own modes (SkyRL averages them per sequence / per token, its policy term
    # per mini-batch token): None = loss_agg_mode.
    kl_loss_agg_mode: Optional[str] = None
    entropy_agg_mode: Optional[str] = None
    loss_token_count: Optional[Count] = None
    loss_seq_count: Optional[Count] = None
    loss_horizon: Optional[Count] = None
    loss_scale: float = 1.0
    log_ratio_clamp: Optional[float] = None
    importance_level: str = "token"  # token | sequence (GSPO)
    kl_loss_input_clamp: Optional[float] = None
    kl_loss_output_clamp: Optional[float] = None
    # The KL term of the loss multiplied by the (unclipped) policy ratio, per token or the sample's under
    # importance_level="sequence" (TRL use_bias_correction_kl, grpo_trainer.py:3104-3105). Unset (falsy) is
    # not written, so a bundle without it is byte-identical to one written before it.
    kl_loss_ratio_weighted: Union[bool, msgspec.UnsetType] = msgspec.UNSET
    # train/rollout importance correction: is_level None = off | token | sequence | geometric
    is_level: Optional[str] = None
    is_mode: str = "truncate"  # truncate | mask (IcePop)
    is_low: Optional[float] = None
    is_high: Optional[float] = None
    is_log_clamp: Optional[float] = None
    value_clip: Optional[float] = None
    # SPEC §4.2, advantage side (reward.post_process, advantage.estimate).
    grpo_std_eps: float = 1e-6
    grpo_std_unbiased: bool = True
    group_baseline: str = "mean"  # mean | leave_one_out
    std_zero: str = "eps"  # eps | skip
    singleton_group: Optional[str] = None  # None = the arithmetic (NaN under std) | nan | zero | raw
    gamma: float = 1.0
    lam: float = 1.0
    kl_in_reward: Optional[str] = None  # None | sequence | token_returns
    kl_penalty_type: Optional[str] = None  # advantage.kl's estimator when it differs from kl_loss_type (verl)
    # What the producer writes at a response's loss-mask-0 tokens (interior tool/observation spans) of the
    # broadcast advantages and the in-reward KL: computed (the value, as on any token; NeMo-RL) | zero (verl and
    # SkyRL multiply by the response mask).
    masked_token_value: str = "computed"
    # What the in-reward KL (the ``kl`` payload) holds at those tokens when it differs from the advantages'
    # rule (SkyRL: the KL × loss_mask, the advantages × response_mask): computed | zero. Unset (msgspec.UNSET)
    # means masked_token_value and is not written, so a bundle without it is byte-identical to one before it.
    kl_masked_token_value: Union[str, msgspec.UnsetType] = msgspec.UNSET
    # OpenRLHF (openrlhf/models/utils.py compute_approx_kl, compute_reward): the in-reward KL estimate clamped to
    # ±kl_penalty_clamp; each sample's (normalized) reward clamped to [reward_clip_low, reward_clip_high].
    kl_penalty_clamp: Optional[float] = None
    reward_clip_low: Optional[float] = None
    reward_clip_high: Optional[float] = None
    advantage_whiten_stats: Optional[AdvantageWhitenStats] = None
    # How advantages are whitened (when they are) and how GAE treats loss-mask-0 tokens. Optional (a minor
    # addition): unset, they read as msgspec.UNSET and mean the first value named, and are not written, so a
    # bundle without them is byte-identical to one written before them.
    # whiten_variance: unbiased (verl masked_whiten, Bessel) | biased (OpenRLHF, over N) | none (centred only,
    # OpenRLHF no_std_norm). whiten_eps_mode: add (verl: the mean over Σmask + 1e-8, the divisor sqrt(var + 1e-8))
    # | clamp (OpenRLHF: the mean over Σmask, the divisor sqrt(max(var, 1e-8))).
    whiten_variance: Union[str, msgspec.UnsetType] = msgspec.UNSET
    whiten_eps_mode: Union[str, msgspec.UnsetType] = msgspec.UNSET
    # gae_masked_tokens: skip (verl: a mask-0 token carries the next value and advantage through unchanged) |
    # zeroed (OpenRLHF: values and rewards × mask, the recursion runs over every token).
    gae_masked_tokens: Union[str, msgspec.UnsetType] = msgspec.UNSET
    # grpo_std_scope: group (each group's own std) | batch (TRL scale_rewards="batch": the group mean, the std of
    # every sample of the step, which must then hold the whole generation batch: one data-parallel rank).
    grpo_std_scope: Union[str, msgspec.UnsetType] = msgspec.UNSET
    # Sample-support replay (stage logprob.support): the vocabulary size for the support id range check, the
    # expert count for routed-expert rows, and which recorded log-prob payloads the trainer scored over the
    # support (None = every recorded one of log_probs, old_log_probs, ref_log_probs).
    vocab_size: Optional[Int] = None
    num_experts: Optional[Int] = None
    support_scored: Optional[list[str]] = None
    # GDPO (advantage_estimator="gdpo"): the weight of each reward component in the sum of their normalized
    # values (unset: 1 each), and whether that sum is then standardized over the step's samples (NeMo-RL:
    # (A − mean)/std, the unbiased std, centred only where it is 0) before advantage.estimate. Unset: not written.
    reward_component_weights: Union[list[float], msgspec.UnsetType] = msgspec.UNSET
    reward_components_standardize: Union[bool, msgspec.UnsetType] = msgspec.UNSET
    # That standardization's divisor: unset, the std (the centred sum where it is 0: NeMo-RL); a number, std + it
    # (TRL's normalize_then_sum, 1e-4).
    reward_components_standardize_eps: Union[float, msgspec.UnsetType] = msgspec.UNSET
    # Length shaping of the raw reward before reward.post_process normalizes it (OpenRLHF
    # trainer/ppo_utils/length_penalty.py): the overlong penalty r − min(L − (max_tokens − buffer), buffer)/buffer ·
    # factor where positive, L the span from the sample's first to its last loss token; then, for a sample recorded
    # truncated, r · coef (coef in [0, 1]) or r := coef (coef < 0). Unset: no shaping, not written.
    overlong_buffer_len: Union[float, msgspec.UnsetType] = msgspec.UNSET
    overlong_penalty_factor: Union[float, msgspec.UnsetType] = msgspec.UNSET
    overlong_max_tokens: Union[Int, msgspec.UnsetType] = msgspec.UNSET
    truncated_reward_coef: Union[float, msgspec.UnsetType] = msgspec.UNSET

    # Gradient replay (stage loss.grad, SPEC §4.3): the factor between the loss the step backpropagated and the
    # recorded loss field (the payload grad_log_probs is ∂(grad_scale·loss)/∂log_probs): 1/k when each of k
    # accumulated micro-batches divides its loss by k before backward while the step reports their sum, the
    # unscaled value of a mixed-precision loss scaler. Unset (1.0) is not written.
    grad_scale: Union[float, msgspec.UnsetType] = msgspec.UNSET
    # The value loss's weight in the loss backpropagated (loss + vf_coef·vf_loss, PPO): grad_values is
    # grad_scale·vf_coef·∂vf_loss/∂values. Unset (1.0) is not written.
    vf_coef: Union[float, msgspec.UnsetType] = msgspec.UNSET

    # The policy-loss family (kernels/families: ppo, cispo, sapo, geo_mean, ...) and its parameters; an unknown
    # family or parameter is refused by loss.policy naming the known ones (exit 4). A family may read a payload of
    # its own: clip_cov the selected-token mask ``clip_cov_mask`` (int 0/1 per token, ``layout.PAYLOAD_FORMS``).
    policy_loss: str = "ppo"
    policy_loss_params: dict[str, Union[float, int, str, bool, None]] = {}

    # Train–inference mismatch (stage logprob.mismatch, SPEC §4.4). true_on_policy: the run declares rollout and
    # trainer log-probs bitwise equal (NeMo-RL zero_train_gen_mismatch, miles --true-on-policy-mode), so every
    # difference on a loss token is a divergence. policy_version: the trainer's policy version at the step;
    # max_policy_lag: the configured staleness bound (verl staleness_threshold, SkyRL max_staleness_steps,
    # NeMo-RL max_trajectory_age_steps, slime --max-policy-version-lag), read with the payload policy_versions.
    # Unset, they are not written, so a bundle without them is byte-identical to one written before them.
    true_on_policy: Union[bool, msgspec.UnsetType] = msgspec.UNSET
    policy_version: Union[Int, msgspec.UnsetType] = msgspec.UNSET
    max_policy_lag: Union[Count, msgspec.UnsetType] = msgspec.UNSET
    # Rejection sampling of the train/rollout correction (verl rollout_rs, rollout_rs_threshold; SPEC §4.4): the
    # loss tokens a chained divergence test rejects leave the loss mask. Unset: not written.
    rollout_rs: Union[str, None, msgspec.UnsetType] = msgspec.UNSET
    rollout_rs_threshold: Union[str, float, None, msgspec.UnsetType] = msgspec.UNSET
    # Off-policy sequence masking (OPSM, DeepSeek-V3.2): a token is dropped when its advantage is < 0 and its
    # sample's mean of ``anchor − log_probs`` over the loss tokens exceeds ``opsm_delta`` (anchor: ``old`` as
    # slime, ``rollout`` as TRL's sampling log-probs). Unset: off, and not written.
    opsm_delta: Union[float, msgspec.UnsetType] = msgspec.UNSET
    opsm_anchor: Union[str, msgspec.UnsetType] = msgspec.UNSET
    # TRL's high-entropy token mask: the policy term kept only where the entropy is >= the (1 − q) quantile of
    # the loss-token entropies of the sample's micro-batch (``micro_batch_id``; the step when none is recorded).
    top_entropy_quantile: Union[float, msgspec.UnsetType] = msgspec.UNSET
    # On-policy distillation against the ``teacher_log_probs`` payload: the reverse-KL estimate
    # ``opd_kl_type(student − teacher)`` clamped to ±opd_clamp, weighted by opd_coef, placed in the advantages
    # (``advantage``: A − coef·estimate, the student being old_log_probs; slime, NeMo-RL, prime-rl) or as a
    # supervised loss term (``loss``: the field opd_loss, aggregated as the policy term, coef·opd_loss added to
    # loss; the student being log_probs; verl). Unset: off, and not written.
    opd_placement: Union[str, msgspec.UnsetType] = msgspec.UNSET
    opd_kl_type: Union[str, msgspec.UnsetType] = msgspec.UNSET
    opd_coef: Union[float, msgspec.UnsetType] = msgspec.UNSET
    opd_clamp: Union[float, None, msgspec.UnsetType] = msgspec.UNSET
    # The 0/1 keep masks of an off-policy correction (SkyRL off_policy_correction's outlier, token and sequence
    # masks; bundle/is_keep.py, SPEC §4.4): each token's policy-loss term × 0/1, the normalizer and metrics kept.
    is_keep: Union[dict[str, list[Optional[float]]], None, msgspec.UnsetType] = msgspec.UNSET
    # The loss's old log-probs taken as the current ones (the ratio 1, NeMo-RL force_on_policy_ratio): the
    # old_log_probs payload is not read by loss.policy (NeMo-RL records zeros there). Unset: false, not written.
    force_on_policy_ratio: Union[bool, msgspec.UnsetType] = msgspec.UNSET
    # The KL term of the loss × exp(log_probs − rollout_log_probs) before its output clamp, a non-finite weight 0
    # (NeMo-RL use_on_policy_kl_approximation). Unset: false, not written.
    kl_loss_rollout_weighted: Union[bool, msgspec.UnsetType] = msgspec.UNSET
    # The KL term's gradient adds the score function's: the estimate × exp(log_probs − sg(log_probs)), value 1
    # (NeMo-RL's KL term without the on-policy approximation, loss_functions.py:487-490); loss.grad only, the loss's
    # value unchanged. Unset: false, not written.
    kl_loss_score_function: Union[bool, msgspec.UnsetType] = msgspec.UNSET
    # opd_placement="advantage": what the distillation term is subtracted from: "returns" (the GRPO returns,
    # slime) or "zero" (the advantage is −coef·estimate alone, NeMo-RL's opd estimator). Unset: "returns".
    opd_base: Union[str, msgspec.UnsetType] = msgspec.UNSET
    # The importance weights divided by their batch mean (verl rollout_is_batch_normalize, slime
    # tis_batch_normalize): the divisor is the step's recorded mean (verl rollout_corr/rollout_is_batch_norm_factor,
    # global across DP), is_batch_norm_factor. Unset: off, and not written.
    is_batch_normalize: Union[bool, msgspec.UnsetType] = msgspec.UNSET
    is_batch_norm_factor: Union[float, msgspec.UnsetType] = msgspec.UNSET
    # The log-probs the train/rollout correction (IS weights, rollout_rs) compares with rollout_log_probs: "old"
    # (decoupled: the trainer's recompute) or "current" (verl bypass_mode: the first minibatch's log_probs,
    # detached, computed inside the loss). Unset: old, and not written.
    rollout_correction_anchor: Union[str, msgspec.UnsetType] = msgspec.UNSET
    # slime's MIS rejection (examples/train_infer_mismatch_helper/mis.py): each [level, low, high] drops the loss
    # tokens whose weight exp(clamp(Δ at level, ±20)) (Δ = old − rollout; level token | sequence | geometric) lies
    # outside [low, high]; mis_veto drops a sample with a loss token whose exp(Δ) is below it. Dropped tokens leave
    # every loss term's numerator while the normalizers stay the unrejected mask's (slime loss.py:1080-1091).
    # Unset: off, and not written.
    mis_rs: Union[list[tuple[str, float, float]], msgspec.UnsetType] = msgspec.UNSET
    mis_veto: Union[float, msgspec.UnsetType] = msgspec.UNSET

    def __post_init__(self) -> None:
        # The loss-side values of SPEC §4.2 (an unknown mode or type, eps_clip_c <= 1 ...): a one-line schema
        # error naming the field (exit 3), never a refusal or a crash in a stage.
        from .loss_knobs import LossKnobs, check_knobs

        errors = check_knobs(LossKnobs.of(self))
        if errors:
            raise ValueError(errors[0])
        if self.grad_scale is not msgspec.UNSET and not (math.isfinite(self.grad_scale) and self.grad_scale != 0):
            raise ValueError(f"grad_scale: expected a finite, non-zero multiplier, got {self.grad_scale!r}")
        if self.vf_coef is not msgspec.UNSET and not math.isfinite(self.vf_coef):
            raise ValueError(f"vf_coef: expected a finite weight, got {self.vf_coef!r}")
        if isinstance(self.rollout_rs, str):
            from .rollout_rs import parse_rollout_rs

            parse_rollout_rs(self.rollout_rs, None if self.rollout_rs_threshold is msgspec.UNSET
                             else self.rollout_rs_threshold)
        if isinstance(self.is_keep, dict):
            from .is_keep import parse_is_keep

            parse_is_keep(self.is_keep)
        factor = self.is_batch_norm_factor
        if factor is not msgspec.UNSET and not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"is_batch_norm_factor: expected a finite divisor > 0, got {factor!r}")
        for k, (level, low, high) in enumerate(self.mis_rs or ()):
            if level not in ("token", "sequence", "geometric") or not (
                    math.isfinite(low) and math.isfinite(high) and 0 < low <= high):
                raise ValueError(f"mis_rs[{k}]: expected [token|sequence|geometric, low, high] with finite "
                                 f"0 < low <= high, got {[level, low, high]!r}")
        if self.mis_veto is not msgspec.UNSET and not (math.isfinite(self.mis_veto) and self.mis_veto > 0):
            raise ValueError(f"mis_veto: expected a finite threshold > 0, got {self.mis_veto!r}")
        if self.rollout_correction_anchor not in (msgspec.UNSET, "old", "current"):
            raise ValueError(f"rollout_correction_anchor: expected one of old, current, got "
                             f"{self.rollout_correction_anchor!r}")
        clamp = self.kl_penalty_clamp
        if clamp is not None and not (math.isfinite(clamp) and clamp > 0):
            raise ValueError(f"kl_penalty_clamp: expected null or a finite value > 0, got {clamp!r}")
        low, high = self.reward_clip_low, self.reward_clip_high
        if (low is None) != (high is None) or (low is not None and not (math.isfinite(low) and math.isfinite(high)
                                                                         and low <= high)):
            raise ValueError(f"reward_clip_low, reward_clip_high: expected both null or finite low <= high, "
                             f"got [{low!r}, {high!r}]")


# The knobs every config summary shows; the others only when set away from their default.
CORE_KNOBS = ("advantage_estimator", "n_samples_per_prompt", "grpo_std_normalization", "kl_loss_type", "kl_coef",
              "eps_clip", "eps_clip_high", "entropy_coef")


def config_changes(config) -> dict:
    """``{knob: value}`` of the knobs a summary shows: :data:`CORE_KNOBS`, then every other knob whose value
    differs from :class:`RecomputeConfig`'s default (``config``: a RecomputeConfig or its dict form)."""
    raw = msgspec.to_builtins(config) if isinstance(config, RecomputeConfig) else dict(config)
    defaults = msgspec.to_builtins(RecomputeConfig())
    return {k: v for k, v in raw.items() if k in CORE_KNOBS or k not in defaults or v != defaults[k]}


class BundleIndex(_Struct, kw_only=True, forbid_unknown_fields=True):
    bundle_id: Id
    identity: Identity
    samples: list[SampleRecord]
    config: RecomputeConfig


class ProducerInfo(_Struct, kw_only=True):
    commit: Id = ""
    dirty_patch_digest: Optional[Id] = None
    torch_version: Id = ""
    # The training framework and its version (e.g. "trl", "1.16.0"): the version whose semantics a framework
    # mapping reads (frameworks/*.py VERSIONS). Optional (a minor addition): absent, they read as msgspec.UNSET
    # (falsy) and are not written, so a bundle without them is byte-identical to one written before them.
    framework: Union[Id, None, msgspec.UnsetType] = msgspec.UNSET
    framework_version: Union[Id, None, msgspec.UnsetType] = msgspec.UNSET

    def __post_init__(self) -> None:
        # ``torch.__version__`` is a str subclass that JSON encoders refuse; store the plain string.
        if type(self.torch_version) is not str:
            force_setattr(self, "torch_version", str(self.torch_version))


class StageContract(_Struct, kw_only=True):
    stage: StageId
    version: str = "v1"
    capability: StageCapability
    implementation: Literal["reuse", "reimplemented"] = "reuse"
    # Informational only (the original writes them empty): the engine knows what each stage consumes.
    inputs: list[str] = []
    expected_outputs: list[str] = []


def stage_contracts(
    stages,
    *,
    capabilities: Optional[dict[StageId, StageCapability]] = None,
    implementations: Optional[dict[StageId, str]] = None,
    declare_value: bool = True,
) -> dict[StageId, StageContract]:
    """Version-1 contracts for ``stages`` (``recompute`` unless ``capabilities`` says otherwise, ``reuse``
    unless ``implementations`` does), plus ``loss.value`` declared unsupported, as V1 producers write, where
    ``stages`` does not ask for it."""
    capabilities = capabilities or {}
    implementations = implementations or {}
    out = {
        s: StageContract(stage=s, version="v1", capability=capabilities.get(s, StageCapability.RECOMPUTE),
                         implementation=implementations.get(s, "reuse"))
        for s in stages
    }
    if declare_value and StageId.LOSS_VALUE not in out:
        out[StageId.LOSS_VALUE] = StageContract(stage=StageId.LOSS_VALUE, version="v1",
                                                capability=StageCapability.UNSUPPORTED)
    return out


# A chunk checksum: 64 lowercase hex digits (SPEC §2.3); a chunk between 64 KiB and 1 GiB (bundle.chunks).
Sha256Hex = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]
ChunkBytes = Annotated[int, msgspec.Meta(ge=1 << 16, le=1 << 30)]


class PayloadChunks(_Struct, kw_only=True):
    """``manifest.payloads[name].chunks`` (format 1.3, optional): the sha256 of each ``bytes``-long chunk of the
    payload file, in file order (the last chunk shorter), so that a selected replay verifies only the chunks it
    reads (``bundle.chunks``)."""

    bytes: ChunkBytes
    sha256: list[Sha256Hex]


class PayloadSpec(_Struct, kw_only=True):
    name: str
    dtype: str
    shape: list[Count]
    bytes: Count
    sha256: str
    # Written for safetensors payloads (SPEC §2.3); absent (never null) in every bundle written before, and in .pt
    # payloads: those are verified whole.
    chunks: Union[PayloadChunks, msgspec.UnsetType] = msgspec.UNSET


# A tolerance is a finite, non-negative number: a negative, NaN or infinite one is a schema error (exit 3).
Bound = Annotated[float, msgspec.Meta(ge=0.0, le=1.7976931348623157e308)]


class Tolerance(_Struct, kw_only=True):
    atol: Bound = 1e-6
    rtol: Bound = 1e-5


class ProducerPrecision(_Struct, kw_only=True):
    """What the producer computed its expected values in (SPEC §5.1): ``compute``, the precision of its
    per-token outputs (a bf16 forward's KL); ``accumulate``, the precision of its reductions. The replay's
    rounding bound for each element is derived from them (``replay_lib.judge.error_model``)."""

    compute: Literal["float32", "bfloat16", "float16"] = "float32"
    accumulate: Literal["float32", "float64"] = "float32"


class ComparisonPolicy(_Struct, kw_only=True):
    exact_fields: list[str] = []
    tolerances: dict[str, Tolerance] = {}
    producer_precision: ProducerPrecision = ProducerPrecision()

    def tolerance(self, stage: str) -> Tolerance:
        return self.tolerances.get(str(stage), Tolerance())


REDACTED_FIELDS = ("prompt", "response", "label", "tool_output", "paths", "endpoints")


class Manifest(_Struct, kw_only=True):
    format_version: Id
    bundle_id: Id
    producer: ProducerInfo
    stage_contracts: dict[StageId, StageContract]
    payloads: dict[str, PayloadSpec]
    comparison_policy: ComparisonPolicy = ComparisonPolicy()
    # {<field>: "hash" | "truncate:N" | "drop"}; a text field without a rule is never written.
    redaction: dict[str, str] = {}
    # Contracts a format-1.0.0 reader cannot take (see ORIGINAL_STAGE_IDS), written here by the writer. On
    # reading they join ``stage_contracts`` (and override a 1.0.0 reader's view of the same stage there), so
    # every reader of ours sees one map whichever placement a bundle uses (our earlier versions wrote
    # ``logprob.support`` into ``stage_contracts``); this field is then left empty.
    extension_stage_contracts: dict[StageId, StageContract] = {}

    def __post_init__(self) -> None:
        if self.extension_stage_contracts:
            merged = {**self.stage_contracts, **self.extension_stage_contracts}
            force_setattr(self, "stage_contracts", dict(sorted(merged.items(), key=lambda kv: kv[0].value)))
            force_setattr(self, "extension_stage_contracts", {})


# An object is read only where the format has one (``$.loss.policy.per_sample``, see
# ``_check_expected_objects``); anywhere else it is refused as before.
ExpectedValue = Union[float, None, list[Optional[float]], dict[str, Any]]
Expected = dict[str, dict[str, ExpectedValue]]

# Per-sample loss terms (SPEC §4; written by our capture): ``expected.json $.loss.policy.per_sample`` holds,
# one float64 per sample in index order, Σ_t x·mask of the surrogate, the entropy and the log-ratio
# (``ppo_kl``), and Σ_t of the clip indicator and of the mask. With them a loss divergence is located to its
# sample, and the clip fraction becomes a ratio of whole numbers that float rounding cannot blur.
PER_SAMPLE_KEY = "per_sample"
PER_SAMPLE_SUMS = ("pg_sum", "entropy_sum", "kl_sum", "kl_loss_sum")
PER_SAMPLE_COUNTS = ("clip_count", "mask_count")
# SPEC §4.2: the weight each sample's sums entered the loss terms with (loss_scale·w_i of loss_agg_mode).
PER_SAMPLE_WEIGHTS = ("loss_weight",)
PER_SAMPLE_TERMS = PER_SAMPLE_SUMS + PER_SAMPLE_COUNTS + PER_SAMPLE_WEIGHTS


class PerSampleLossTerms(_Struct, kw_only=True, omit_defaults=True):
    """``$.loss.policy.per_sample``: the terms a producer recorded (an absent or null one is not compared;
    one this reader does not know is ignored, as a later minor version may add terms). A NaN in a sum is
    read, and so is a null (msgspec writes a NaN as null): either diverges where it is compared; a count must
    be a whole number ≥ 0."""

    pg_sum: Optional[list[Optional[float]]] = None
    entropy_sum: Optional[list[Optional[float]]] = None
    kl_sum: Optional[list[Optional[float]]] = None
    kl_loss_sum: Optional[list[Optional[float]]] = None  # Σ_t kl·mask of the KL term in the loss (SPEC §4.2)
    clip_count: Optional[list[float]] = None
    mask_count: Optional[list[float]] = None
    loss_weight: Optional[list[Optional[float]]] = None  # loss_scale·w_i the producer applied (SPEC §4.2)

    def recorded(self) -> dict[str, list[Optional[float]]]:
        """``{term: values}`` of the terms present, in ``PER_SAMPLE_TERMS`` order."""
        return {k: v for k in PER_SAMPLE_TERMS if (v := getattr(self, k)) is not None}


def loss_terms_length_error(expected: Expected, n_samples: int) -> Optional[str]:
    """The first per-sample term whose length is not the bundle's sample count, as the message after the
    file name (``"$.loss.policy.per_sample.pg_sum: 3 value(s) for 4 sample(s)"``), else ``None``."""
    terms = expected.get("loss.policy", {}).get(PER_SAMPLE_KEY)
    if not isinstance(terms, PerSampleLossTerms):
        return None
    for key, values in terms.recorded().items():
        if len(values) != n_samples:
            return (f"$.loss.policy.{PER_SAMPLE_KEY}.{key}: {len(values)} value(s) for {n_samples} sample(s) "
                    "(expected one per sample of index.json $.samples)")
    return None


class RankComplete(_Struct, kw_only=True):
    """``COMPLETE.<rank>``: the rank's identity anchor, payload and metadata checksums."""

    actor_step_id: Optional[ActorStepId] = None
    rollout_id: Optional[Int] = None
    payloads: dict[str, str] = {}
    metadata: dict[str, str] = {}
    expected_ranks: Optional[list[Count]] = None
    relpath: Optional[str] = None
    bundle_id: Optional[Id] = None

    def anchor(self) -> tuple:
        """What the shards of one cohort agree on. Not ``bundle_id``: the original's shards do not record it
        (the finalizer compares the ones that do)."""
        return (self.actor_step_id, self.rollout_id, tuple(self.expected_ranks or ()))


class BundleComplete(_Struct, kw_only=True):
    """``COMPLETE``: single producer → ranks + metadata checksums; cohort → ranks + every shard."""

    ranks: list[Count]
    metadata: Optional[dict[str, str]] = None
    shards: Optional[dict[str, RankComplete]] = None

    @property
    def early_writer(self) -> bool:
        """A bundle directory's COMPLETE as the original's early writer (93902db) published it: ``ranks``
        only, without the JSON files' checksums (neither ``metadata`` nor a cohort's ``shards``)."""
        return self.metadata is None and self.shards is None


# What the reader and ``inspect`` say of such a COMPLETE (after its path) when no rank sentinel has the
# checksums either.
EARLY_COMPLETE_WARNING = ("$.metadata: absent (written by an early 1.0.0 writer): the JSON files' checksums "
                          "were not verified")


class RedactionPolicy:
    """Applies ``{field: rule}`` rules: ``hash`` (sha256 hex), ``truncate:N``, ``drop``."""

    def __init__(self, rules: dict[str, str]):
        for field, rule in rules.items():
            parse_redaction_rule(field, rule)
        self.rules = dict(rules)

    def apply(self, field: str, value: Optional[str]) -> Optional[str]:
        import hashlib

        if value is None:
            return None
        rule = self.rules.get(field, "drop")
        kind, n = parse_redaction_rule(field, rule)
        if kind == "hash":
            return hashlib.sha256(value.encode("utf-8")).hexdigest()
        if kind == "truncate":
            return value[:n]
        return None


def parse_redaction_rule(field: str, rule: str) -> tuple[str, int]:
    if rule in ("hash", "drop"):
        return rule, 0
    if rule.startswith("truncate:"):
        tail = rule.split(":", 1)[1]
        if tail.isascii() and tail.isdigit():
            return "truncate", int(tail)
    raise ValueError(f"redaction rule for {field!r} must be 'hash', 'drop' or 'truncate:N', got {rule!r}")


def lenient_mirror(typ, _memo: dict | None = None):
    """The same type tree with unknown fields allowed on every Struct (the index-tree types forbid
    them, so that the usual document is decoded and proved free of unknown fields in one pass)."""
    import typing

    memo = {} if _memo is None else _memo
    if isinstance(typ, type) and issubclass(typ, msgspec.Struct):
        if typ not in memo:
            hints = typing.get_type_hints(typ, include_extras=True)  # keeps the int64 bounds
            fields = []
            for f in msgspec.structs.fields(typ):
                if f.default is not msgspec.NODEFAULT:
                    default = msgspec.field(default=f.default, name=f.encode_name)
                elif f.default_factory is not msgspec.NODEFAULT:
                    default = msgspec.field(default_factory=f.default_factory, name=f.encode_name)
                else:
                    default = msgspec.field(name=f.encode_name)
                fields.append((f.name, lenient_mirror(hints[f.name], memo), default))
            memo[typ] = msgspec.defstruct(f"Lenient{typ.__name__}", fields, kw_only=True, forbid_unknown_fields=False)
        return memo[typ]
    origin, args = typing.get_origin(typ), typing.get_args(typ)
    if origin in (list, tuple, dict, set, frozenset) and args:
        return origin[tuple(lenient_mirror(a, memo) for a in args)]
    if origin is Union:
        return Union[tuple(lenient_mirror(a, memo) for a in args)]
    return typ


# One encoder / decoder per type, reused.
JSON_ENCODER = msgspec.json.Encoder(order="sorted")
MANIFEST_DECODER = msgspec.json.Decoder(Manifest)
INDEX_DECODER = msgspec.json.Decoder(BundleIndex)  # forbids unknown fields: see decode_index
LENIENT_INDEX_DECODER = msgspec.json.Decoder(lenient_mirror(BundleIndex))
EXPECTED_DECODER = msgspec.json.Decoder(Expected)
RANK_COMPLETE_DECODER = msgspec.json.Decoder(RankComplete)
BUNDLE_COMPLETE_DECODER = msgspec.json.Decoder(BundleComplete)


class _IndexOfRawSamples(_Struct, kw_only=True, forbid_unknown_fields=True):
    """:class:`BundleIndex` with each sample left as its JSON text (a zero-copy slice of the document)."""

    bundle_id: Id
    identity: Identity
    samples: list[msgspec.Raw]
    config: RecomputeConfig


_INDEX_RAW_SAMPLES_DECODER = msgspec.json.Decoder(_IndexOfRawSamples)
_SAMPLES_DECODER = msgspec.json.Decoder(list[SampleRecord])
_SAMPLES_PER_CHUNK = 1024
# Shared by the records: values many samples repeat (a micro-batch's or a group's ids, lengths, scores, a short
# loss mask) are kept once. A float table stops growing at this many distinct values (a score per sample would
# otherwise cost a table entry each and share nothing); a loss mask longer than this many tokens is not shared
# (its values, not its object, are its cost, and two such masks are rarely equal).
_SHARED_FLOATS_MAX = 4096
_SHARED_MASK_TOKENS = 64
_SHARED_TEXT = ("label", "label_hash", "prompt")


def _shared_samples(raws: list) -> list[SampleRecord]:
    """The records of ``raws`` (a list of :class:`msgspec.Raw`, emptied as it is read), decoded a chunk at a time;
    each chunk's repeated values are replaced by the first equal one decoded, so duplicates never pile up. Equal
    here means the same type and value: an int and a float, or 0.0 and -0.0, are never merged."""
    strs: dict = {}
    ints: dict = {}
    floats: dict = {}
    masks: dict = {}
    share, text, ints_kept, floats_kept, masks_kept = force_setattr, strs.setdefault, ints.setdefault, floats.get, \
        masks.setdefault
    out: list[SampleRecord] = []
    for start in range(0, len(raws), _SAMPLES_PER_CHUNK):
        stop = start + _SAMPLES_PER_CHUNK
        chunk = _SAMPLES_DECODER.decode(b"[" + b",".join(raws[start:stop]) + b"]")
        raws[start:stop] = [None] * len(chunk)  # each sample's text is let go once decoded
        for rec in chunk:  # unrolled: a loop over field names takes twice as long
            value = rec.micro_batch_id
            if value is not None and (kept := text(value, value)) is not value:
                share(rec, "micro_batch_id", kept)
            value = rec.consumer_batch_id
            if type(value) is str and (kept := text(value, value)) is not value:
                share(rec, "consumer_batch_id", kept)
            value = rec.group_index
            if value is not None and (kept := ints_kept(value, value)) is not value:
                share(rec, "group_index", kept)
            value = rec.response_length
            if (kept := ints_kept(value, value)) is not value:
                share(rec, "response_length", kept)
            value = rec.total_length
            if (kept := ints_kept(value, value)) is not value:
                share(rec, "total_length", kept)
            value = rec.raw_reward
            if value:  # not None, not ±0.0 (equal as keys, not as values)
                if (kept := floats_kept(value)) is None:
                    if len(floats) < _SHARED_FLOATS_MAX:
                        floats[value] = value
                elif kept is not value:
                    share(rec, "raw_reward", kept)
            value = rec.reward
            if type(value) is float and value:  # a per-token list is the sample's own
                if (kept := floats_kept(value)) is None:
                    if len(floats) < _SHARED_FLOATS_MAX:
                        floats[value] = value
                elif kept is not value:
                    share(rec, "reward", kept)
            value = rec.loss_mask
            if value is not msgspec.UNSET and len(value) <= _SHARED_MASK_TOKENS and (kept := masks_kept(tuple(value), value)) is not value:
                share(rec, "loss_mask", kept)
            if rec.prompt is not None or rec.label is not None or rec.label_hash is not None:
                for name in _SHARED_TEXT:  # rarely present (redacted by default): a group's prompt, label
                    value = getattr(rec, name)
                    if value is not None and (kept := text(value, value)) is not value:
                        share(rec, name, kept)
        out += chunk
    return out


def decode_index_strict(blob: bytes) -> tuple[BundleIndex, bool]:
    """:func:`decode_index` of a document without unknown fields; raises for any other. Its schema has only
    concrete types, so what it decodes nests a few levels deep at most (``bundle.files._decode``).

    The samples are decoded from their JSON slices a chunk at a time, their repeated values shared
    (:func:`_shared_samples`): the records of a large index take about half the memory of a decode in one piece.
    What it accepts is what :data:`INDEX_DECODER` accepts, and it returns an equal index; its errors are worded
    for the slices (``$[3].loss_mask``), so a caller that reports one decodes the document in one piece instead
    (:func:`decode_index` does)."""
    head = _INDEX_RAW_SAMPLES_DECODER.decode(blob)
    samples = _shared_samples(head.samples)
    return BundleIndex(bundle_id=head.bundle_id, identity=head.identity, samples=samples, config=head.config), False


def decode_index(blob: bytes) -> tuple[BundleIndex, bool]:
    """``(index, whether it has fields this reader does not know)``: :func:`decode_index_strict`, or, when that
    fails, :func:`decode_index_whole` (which words the error, or reads the unknown fields)."""
    try:
        return decode_index_strict(blob)
    except Exception:  # worded, or read leniently, by the one-piece decode
        return decode_index_whole(blob)


def decode_index_whole(blob: bytes) -> tuple[BundleIndex, bool]:
    """:func:`decode_index` in one piece. The usual document takes one strict decode (which proves it has no
    unknown fields); one with unknown fields is decoded leniently (raising its real problem, if it has another)
    and rebuilt without them. Raises ``msgspec.DecodeError`` / ``ValidationError``."""
    try:
        try:
            return INDEX_DECODER.decode(blob), False
        except msgspec.ValidationError:
            lenient = LENIENT_INDEX_DECODER.decode(blob)
            return msgspec.convert(msgspec.to_builtins(lenient), BundleIndex), True
    except msgspec.DecodeError as exc:
        if isinstance(exc, msgspec.ValidationError):
            raise
        # the original writes a non-finite reward as Python's bare NaN / Infinity literal (both majors read it so)
        doc = _python_json(blob, exc)
        try:
            return msgspec.convert(doc, BundleIndex), False
        except msgspec.ValidationError:
            lenient = msgspec.convert(doc, LENIENT_INDEX_DECODER.type)
            return msgspec.convert(msgspec.to_builtins(lenient), BundleIndex), True


def decode_expected(blob: bytes) -> Expected:
    """expected.json. The original writes it with Python's ``json``, which spells a non-finite float as the
    bare literal ``NaN``, ``Infinity`` or ``-Infinity``; msgspec (strict JSON) refuses those. So a document
    msgspec finds malformed and that holds one is read by the stdlib parser (which takes them as floats:
    a NaN still diverges wherever it is compared) and then validated as usual; a document malformed
    otherwise too is reported where the stdlib parser stopped (msgspec stopped at the literal). The usual
    document takes the one fast decode. Raises ``msgspec.DecodeError`` / ``ValidationError``."""
    try:
        return _check_expected_objects(EXPECTED_DECODER.decode(blob))
    except msgspec.DecodeError as exc:
        if b"NaN" not in blob and b"Infinity" not in blob:
            raise _keyed(exc, blob) from None
        return _check_expected_objects(msgspec.convert(_python_json(blob, exc), Expected))


def _python_json(blob: bytes, exc: Exception):
    """``blob`` parsed by the stdlib (which reads the bare ``NaN`` / ``Infinity`` / ``-Infinity`` literals Python's
    json writes as floats), after msgspec refused it with ``exc``: raises ``exc`` when the document holds no such
    literal, is not UTF-8 or is nested too deep, and a ``DecodeError`` naming the byte where the stdlib stopped
    when it is malformed otherwise too."""
    if b"NaN" not in blob and b"Infinity" not in blob:
        raise exc
    try:
        text = blob.decode("utf-8")
        return json.loads(text)
    except json.JSONDecodeError as bad:
        at = len(text[:bad.pos].encode("utf-8"))
        raise msgspec.DecodeError(f"JSON is malformed: {bad.msg[:1].lower()}{bad.msg[1:]} (byte {at})") from None
    except (ValueError, RecursionError):  # not UTF-8 (the caller names the byte), or nested too deep
        raise exc from None


_EXPECTED_KEYS_DECODER = msgspec.json.Decoder(dict[str, dict[str, msgspec.Raw]])
_VALUE_DECODER = msgspec.json.Decoder(ExpectedValue)


def _keyed(exc: Exception, blob: bytes) -> Exception:
    """``exc`` with msgspec's ``$[...][...]`` (it does not name dict keys) replaced by the stage and key of the value
    that failed — found by decoding each value on its own, only once a decode has failed; ``exc`` as it is when
    the document's shape does not even get that far."""
    if "`$[...][...]" not in str(exc):
        return exc
    try:
        stages = _EXPECTED_KEYS_DECODER.decode(blob)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return exc
    for stage, values in stages.items():
        for key, raw in values.items():
            try:
                _VALUE_DECODER.decode(raw)
            except (msgspec.DecodeError, msgspec.ValidationError) as bad:
                message = str(bad).replace("`$", f"`$.{stage}.{key}", 1)
                return type(exc)(message)
    return exc


def _check_expected_objects(doc: Expected) -> Expected:
    """``$.loss.policy.per_sample`` decoded as :class:`PerSampleLossTerms`; an object anywhere else, or a
    per_sample that is not one, is a ``ValidationError`` naming its path (``$.<stage>.<key>…``: msgspec
    itself would say ``$[...][...]``). A handful of keys: nothing here walks a list."""
    for stage, values in doc.items():
        for key, value in values.items():
            where = f"$.{stage}.{key}"
            if stage == "loss.policy" and key == PER_SAMPLE_KEY:
                if value is not None:  # null: not recorded, like an absent key
                    values[key] = _loss_terms(value, where)
            elif isinstance(value, dict):
                raise msgspec.ValidationError(f"Expected `float | array | null`, got `object` - at `{where}`")
    return doc


def _loss_terms(raw, where: str) -> PerSampleLossTerms:
    if not isinstance(raw, dict):
        kind = "array" if isinstance(raw, list) else "float"
        raise msgspec.ValidationError(f"Expected `object` (the per-sample loss terms), got `{kind}` - at `{where}`")
    try:
        terms = msgspec.convert(raw, PerSampleLossTerms)
    except msgspec.ValidationError as exc:  # "… - at `$.pg_sum[1]`": rooted at the object itself
        raise msgspec.ValidationError(str(exc).replace("- at `$", f"- at `{where}", 1)) from None
    for key in PER_SAMPLE_COUNTS:
        for i, value in enumerate(getattr(terms, key) or ()):
            if not (math.isfinite(value) and value >= 0 and value.is_integer()):
                raise msgspec.ValidationError(
                    f"Expected a whole number >= 0 (a token count), got {value!r} - at `{where}.{key}[{i}]`")
    return terms


def encode_json(obj) -> bytes:
    """The wire form of the original tool: 2-space indent, sorted keys, UTF-8, one trailing newline."""
    return msgspec.json.format(JSON_ENCODER.encode(obj), indent=2) + b"\n"


_LITERALS = {"nan": b"NaN", "inf": b"Infinity", "-inf": b"-Infinity"}


def encode_json_literals(doc, paths) -> bytes:
    """:func:`encode_json` of ``doc`` (builtins: dicts, lists, floats …) with each non-finite float at ``paths``
    written as Python's json writes it (``NaN``, ``Infinity``, ``-Infinity``), the form both majors of the original
    tool read (msgspec alone writes ``null``, which they cannot take as a number). ``paths(doc)`` yields
    ``(container, key)`` pairs whose value may be a float or a list of floats; only those are looked at (the
    loss masks of a large index are never walked). A document without a non-finite value there is encoded as
    :func:`encode_json` does."""
    import secrets

    marks: dict[str, bytes] = {}
    nonce = None

    def mark(value: float) -> str:
        nonlocal nonce
        if nonce is None:
            nonce = "\u2063nf-" + secrets.token_hex(8) + "-"
        token = nonce + repr(value)
        marks[token] = _LITERALS[repr(value)]
        return token

    for container, key in paths(doc):
        value = container[key]
        if type(value) is float and not math.isfinite(value):
            container[key] = mark(value)
        elif type(value) is list:
            for i, item in enumerate(value):
                if type(item) is float and not math.isfinite(item):
                    value[i] = mark(item)
    blob = encode_json(doc)
    for token, literal in marks.items():
        quoted = JSON_ENCODER.encode(token)
        blob = blob.replace(quoted, literal)
    return blob


def index_float_paths(doc: dict):
    """The places of index.json's (builtins) floats a producer may leave non-finite: each sample's rewards."""
    for sample in doc.get("samples", ()):
        for key in ("raw_reward", "reward"):
            if sample.get(key) is not None:
                yield sample, key


def expected_float_paths(doc: dict):
    """Every value of expected.json (builtins), and each per-sample loss term's list."""
    for values in doc.values():
        for key, value in values.items():
            if isinstance(value, dict):
                for term in value:
                    yield value, term
            else:
                yield values, key


def unknown_fields(raw, typ, path: str = "$") -> list[str]:
    """Paths of keys present in decoded JSON ``raw`` that ``typ`` (a Struct tree) does not know."""
    return _unknown(raw, _type_info(typ), path)


@functools.lru_cache(maxsize=None)
def _type_info(typ):
    return msgspec.inspect.type_info(typ)  # ~1 ms for the manifest's tree: once per type, not per open


def _unknown(raw, info, path: str) -> list[str]:
    mi = msgspec.inspect
    out: list[str] = []
    if isinstance(info, mi.StructType) and isinstance(raw, dict):
        fields = {f.encode_name: f for f in info.fields}
        for key, value in raw.items():
            if key not in fields:
                out.append(f"{path}.{key}")
            elif _may_nest(fields[key].type):
                out += _unknown(value, fields[key].type, f"{path}.{key}")
    elif isinstance(info, mi.UnionType):
        for member in info.types:
            if isinstance(member, (mi.StructType, mi.ListType, mi.DictType)):
                out += _unknown(raw, member, path)
    elif isinstance(info, mi.ListType) and isinstance(raw, list):
        item_type = info.item_type
        if isinstance(item_type, mi.StructType):
            # A list of records (thousands of samples): a set difference per item, recursion only into
            # the fields that can hold keys themselves.
            known = {f.encode_name for f in item_type.fields}
            nested = [f for f in item_type.fields if _may_nest(f.type)]
            for i, item in enumerate(raw):
                if not isinstance(item, dict):
                    continue
                for key in sorted(item.keys() - known):
                    out.append(f"{path}[{i}].{key}")
                for f in nested:
                    if f.encode_name in item:
                        out += _unknown(item[f.encode_name], f.type, f"{path}[{i}].{f.encode_name}")
        elif _may_nest(item_type):  # a list of scalars (a loss mask: millions of ints) has no keys
            for i, item in enumerate(raw):
                out += _unknown(item, item_type, f"{path}[{i}]")
    elif isinstance(info, mi.DictType) and isinstance(raw, dict):
        if _may_nest(info.value_type):
            for key, value in raw.items():
                out += _unknown(value, info.value_type, f"{path}.{key}")
    return out


def _may_nest(info) -> bool:
    """Whether a value of this type can hold object keys (a Struct, somewhere below)."""
    mi = msgspec.inspect
    if isinstance(info, mi.UnionType):
        return any(_may_nest(member) for member in info.types)
    if isinstance(info, mi.ListType):
        return _may_nest(info.item_type)
    if isinstance(info, mi.DictType):
        return _may_nest(info.value_type)
    return isinstance(info, mi.StructType)
