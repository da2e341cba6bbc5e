"""GPU smoke test for capture: CUDA tensors go through the writer thread, the bundles replay on the CPU.

    python examples/gpu_smoke.py                 # needs CUDA; prints "skipped: no CUDA" and exits 0 without
    python examples/gpu_smoke.py --device cpu    # the same path with CPU tensors (what CI without a GPU runs)

What it checks on a GPU:
* the tensors are produced on a *side* CUDA stream behind a deliberately slow kernel, and submitted from that
  stream: the capture's device-side copies and the writer thread's device→host copies must wait for them
  (``submit`` records a CUDA event; the writer synchronizes on it, the training thread never does);
* one rollout-level and one step-level bundle (two micro-batches) are written and replay clean on the CPU;
  the step's log-probs are scored over a recorded sampler support, whose rows (int ids, bf16 member logits
  cast to float32 by the writer) ride along as side channels and replay through ``logprob.support``;
* every payload read back equals, bit for bit, the device tensor that was submitted.
Exit status: 0 pass (or skipped), 1 a check failed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path
from typing import Optional, Sequence

import torch

from capture import CaptureConfig, Provenance, ReplayCapture
from replay_lib.bundle import BundleReader
from replay_lib.kernels import LOSS_FIELDS, get_grpo_returns, group_normalize, policy_loss_fields, rollout_kl
from replay_lib.run.runner import replay
from replay_lib.bundle.schema import RecomputeConfig
from replay_lib.kernels.support import support_logprobs

VOCAB, TOP_K = 32, 4
CFG = RecomputeConfig(advantage_estimator="grpo", n_samples_per_prompt=4, grpo_std_normalization=True,
                      kl_loss_type="low_var_kl", kl_coef=0.05, eps_clip=0.2, eps_clip_high=0.28, entropy_coef=0.01,
                      vocab_size=VOCAB)


def _slow_kernel(device: torch.device) -> torch.Tensor:
    """A few large matmuls queued ahead of the payloads, so an unsynchronized copy would read garbage."""
    x = torch.randn(2048, 2048, device=device)
    for _ in range(6):
        x = torch.tanh(x @ x / 64.0)
    return x[0, 0] * 0.0


def run(device: torch.device, directory: Path) -> list[str]:
    """Capture on ``device``; return the failed checks (empty = pass)."""
    gen = torch.Generator().manual_seed(7)
    n, lengths = 8, torch.tensor([5, 3, 6, 4, 2, 7, 5, 4])
    total = int(lengths.sum())
    groups = torch.arange(n) // 4
    raw = torch.randint(0, 5, (n,), generator=gen).to(torch.float32)
    old = -torch.rand(total, generator=gen) * 2
    ref = old + (torch.rand(total, generator=gen) - 0.5) * 0.2
    # Sample support: TOP_K distinct ids per token, bf16 member logits (as a trainer's forward gives them),
    # a sampled member; the policy log-probs are renormalized over the support.
    support_ids = torch.rand(total, VOCAB, generator=gen).argsort(1)[:, :TOP_K].to(torch.int32)
    member_logits = (torch.randn(total, TOP_K, generator=gen) * 2).to(torch.bfloat16)
    sampled = support_ids.gather(1, torch.randint(0, TOP_K, (total, 1), generator=gen)).squeeze(1).to(torch.int64)
    logp = support_logprobs(support_ids, member_logits.float(), sampled)
    entropy = torch.rand(total, generator=gen)
    mask = (torch.rand(total, generator=gen) < 0.9).to(torch.float32)
    # The expected numbers come from the same kernels the replay runs (they are CPU kernels).
    rewards = group_normalize(raw, groups, CFG.grpo_std_normalization)
    kl = rollout_kl(old, ref, CFG.kl_coef, CFG.kl_loss_type)
    advantages = get_grpo_returns(rewards, lengths)
    halves = [(0, 4), (4, 8)]
    offsets = (torch.cumsum(lengths, 0) - lengths).tolist()

    def tok(a: int, b: int) -> slice:
        return slice(offsets[a], offsets[b - 1] + int(lengths[b - 1]))

    fields = {name: torch.zeros(()) for name in LOSS_FIELDS}
    for a, b in halves:
        mb = policy_loss_fields(logp[tok(a, b)], old[tok(a, b)], advantages[tok(a, b)], entropy[tok(a, b)],
                                mask[tok(a, b)], lengths[a:b], eps_clip=CFG.eps_clip,
                                eps_clip_high=CFG.eps_clip_high, entropy_coef=CFG.entropy_coef)
        for name in LOSS_FIELDS:
            fields[name] += mb[name]

    cuda = device.type == "cuda"
    side = torch.cuda.Stream(device) if cuda else None
    if cuda:
        side.wait_stream(torch.cuda.current_stream(device))
    submitted: dict[str, torch.Tensor] = {}
    cap = ReplayCapture(CaptureConfig(enabled=True, directory=directory), CFG, register_atexit=False)
    with torch.cuda.stream(side) if cuda else nullcontext():
        delay = _slow_kernel(device)

        def on_device(name: str, t: torch.Tensor) -> torch.Tensor:
            d = t.to(device, non_blocking=True) + delay.to(t.dtype)  # finishes only after the slow kernel
            submitted[name] = d
            return d

        ids = [f"s-{i}" for i in range(n)]
        ok = cap.capture_rollout(
            0, sample_ids=ids, group_index=groups.tolist(), response_lengths=lengths.tolist(),
            total_lengths=(lengths + 6).tolist(), loss_mask=on_device("loss_mask", mask),
            raw_rewards=on_device("raw_rewards", raw), rewards=on_device("rewards", rewards),
            old_log_probs=on_device("old_log_probs", old), ref_log_probs=on_device("ref_log_probs", ref),
            kl=on_device("kl", kl), advantages=on_device("advantages", advantages),
            prompts=[f"prompt {i}" for i in range(n)], provenance=Provenance(rollout_weight=0, actor_weight=1),
        )
        step = cap.begin_step(0, 0, provenance=Provenance(rollout_weight=0, actor_weight=1),
                              support_scored=("log_probs",))
        for a, b in halves:
            ok &= step.add_micro_batch(
                sample_ids=ids[a:b], group_index=groups[a:b].tolist(), response_lengths=lengths[a:b].tolist(),
                total_lengths=(lengths[a:b] + 6).tolist(), loss_mask=on_device(f"mask{a}", mask[tok(a, b)]),
                log_probs=on_device(f"log_probs{a}", logp[tok(a, b)]),
                old_log_probs=on_device(f"old{a}", old[tok(a, b)]),
                advantages=on_device(f"adv{a}", advantages[tok(a, b)]),
                entropy=on_device(f"entropy{a}", entropy[tok(a, b)]),
                side_channels={"support_ids": on_device(f"support_ids{a}", support_ids[tok(a, b)]),
                               "support_logits": on_device(f"support_logits{a}", member_logits[tok(a, b)]),
                               "sampled_token_ids": on_device(f"sampled{a}", sampled[tok(a, b)])},
            )
        ok &= step.finish({name: on_device(f"field-{name}", value) for name, value in fields.items()})
    failures = [] if ok else ["a capture record was dropped"]
    if not cap.close(timeout=120):
        failures.append("capture did not flush within 120 s")
    stats = cap.stats
    if (stats.written, stats.errors, stats.dropped, stats.abandoned) != (2, 0, 0, 0):
        failures.append(f"capture stats {stats}")
        return failures
    for name in ("rollout-0", "step-0-0"):
        report = replay(directory / name)
        print(f"{name}: {'pass' if report.passed else 'FAIL'} "
              f"({', '.join(f'{s.stage}={s.status}' for s in report.stages if s.status != 'skipped')})")
        if not report.passed:
            failures.append(f"{name}: first divergent stage {report.first_divergent_stage}")
    rollout = BundleReader(directory / "rollout-0")
    step_bundle = BundleReader(directory / "step-0-0")
    pairs = [(rollout.payload(k), submitted[k]) for k in ("old_log_probs", "ref_log_probs", "kl", "advantages")]
    for name in ("log_probs", "support_ids", "sampled"):
        payload = "sampled_token_ids" if name == "sampled" else name
        pairs.append((step_bundle.payload(payload), torch.cat([submitted[f"{name}0"], submitted[f"{name}4"]])))
    # bf16 member logits are written as float32 (exactly: every bf16 value is a float32 value)
    pairs.append((step_bundle.payload("support_logits"),
                  torch.cat([submitted["support_logits0"], submitted["support_logits4"]]).float()))
    for got, sent in pairs:
        if not torch.equal(got, sent.cpu()):
            failures.append("a payload read back differs from the submitted device tensor")
    return failures


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("skipped: no CUDA (torch.cuda.is_available() is False); nothing was run")
        return 0
    with tempfile.TemporaryDirectory(prefix="capture-smoke-") as tmp:
        failures = run(device, Path(tmp))
    for failure in failures:
        print(f"FAIL: {failure}")
    print(f"gpu smoke on {device}: {'FAIL' if failures else 'pass'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
