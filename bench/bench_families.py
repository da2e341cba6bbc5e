"""Cost of ``trajectory-replay replay`` with each policy-loss family configured (``RecomputeConfig.policy_loss``),
against the I/O floor of ``bench_replay.py``.

Builds the 1× synthetic bundle of ``bench_replay.py`` and, from its payloads (same seed), one bundle per family
(verl's token mean over a recorded count × dp 4, the family's parameters, its loss fields as the float64 kernel
reports them: it replays clean; a family that reads the rollout's log-probs gets a ``rollout_log_probs`` payload,
Clip-Cov a ``clip_cov_mask`` drawn as verl draws (its size among the candidates of each micro-batch), KL-Cov and Clip-Cov the synthetic bundle's
micro-batches of 8 samples), then measures each replay as a fresh process, interleaved with the floor (``import
torch`` + read and sha256 every payload file) and the plain PPO replay. Prints the medians and PASS/FAIL for
replay(family) / floor ≤ 1.5 (wall), the bound ``bench_replay.py`` holds the PPO replay to.

    python bench/bench_families.py [--samples 256] [--tokens 8192] [--reps 5] [--keep DIR]
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import FLOOR_CODE, build_bundles, bundle_args, cli_cmd, measure, report, workdir  # noqa: E402

FLOOR_LIMIT = 1.5
# family → (its parameters, the config fields the verl mapping sets with it)
FAMILIES = {
    "cispo": ({}, {"eps_clip_high": 0.28, "log_ratio_clamp": 20.0}),
    "sapo": ({"tau_pos": 1.0, "tau_neg": 1.05}, {"log_ratio_clamp": 20.0}),
    "geo_mean": ({}, {}),
    "dppo_tv": ({"trunc": 3.0}, {"log_ratio_clamp": 20.0}),
    "dppo_kl": ({"trunc": 3.0}, {"log_ratio_clamp": 20.0}),
    "dro": ({"beta": 0.1}, {}),
    "gpg": ({}, {}),
    "kl_cov": ({"ppo_kl_coef": 0.1}, {"log_ratio_clamp": None}),
    "clip_cov": ({"clip_cov_ratio": 0.002, "clip_cov_lb": 0.05}, {"log_ratio_clamp": None}),
    "vespo": ({}, {}),
    "ipo": ({}, {}),
    "icepop": ({}, {}),
    "rollout_is": ({}, {}),
    "importance_sampling": ({}, {}),
    "cross_entropy": ({}, {}),
    "dppo_mu": ({}, {}),
}
FAMILY_CODE = (
    "import json, sys\n"
    "import msgspec, torch\n"
    "from replay_lib.demo import synthetic_parts, write_bundle\n"
    "from replay_lib.kernels.loss import LossKnobs, policy_fields_for, policy_loss_fields\n"
    "name, params, extra = sys.argv[4], json.loads(sys.argv[5]), json.loads(sys.argv[6])\n"
    "m, index, expected, payloads = synthetic_parts(samples=int(sys.argv[2]), tokens=int(sys.argv[3]), kl_coef=0.0,\n"
    "                                               bundle_id=f'family-{name}-bench')\n"
    "mask = torch.tensor([x for s in index.samples for x in s.loss_mask], dtype=torch.float32)\n"
    "lengths = torch.tensor([s.response_length for s in index.samples])\n"
    "cfg = msgspec.structs.replace(index.config, loss_agg_mode='token_mean', loss_token_count=4 * int(mask.sum()),\n"
    "                              loss_scale=4.0, policy_loss=name, policy_loss_params=params, **extra)\n"
    "knobs = LossKnobs.of(cfg, index.samples)\n"
    "from replay_lib.kernels.families import FAMILIES, token_payloads\n"
    "g = torch.Generator().manual_seed(11)\n"
    "if 'rollout_log_probs' in FAMILIES[name].payloads or name == 'dppo_mu':\n"
    "    payloads['rollout_log_probs'] = payloads['old_log_probs'] + 0.02 * torch.randn(mask.numel(), generator=g)\n"
    "tokens = None\n"
    "if 'clip_cov_mask' in token_payloads(name):  # a draw of verl's size among its candidates, per micro-batch\n"
    "    from replay_lib.kernels.loss import sample_log_terms\n"
    "    f64 = torch.float64\n"
    "    none = {'clip_cov_mask': torch.zeros(mask.numel(), dtype=torch.int8)}\n"
    "    st = sample_log_terms(payloads['log_probs'], payloads['old_log_probs'], None, mask, lengths, knobs, f64,\n"
    "                          advantages=payloads['advantages'], family_tokens=none)\n"
    "    seg = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)\n"
    "    t = FAMILIES[name].token_terms(payloads['log_probs'], payloads['old_log_probs'], payloads['advantages'],\n"
    "                                   knobs, seg=seg, sample_terms=st, dtype=f64, tokens=none)\n"
    "    mb = torch.tensor(knobs.micro_batch)[seg]\n"
    "    drawn = torch.zeros(mask.numel(), dtype=torch.int8)\n"
    "    for b in range(int(mb.max()) + 1):\n"
    "        at = (mb == b) & (mask > 0)\n"
    "        cand = torch.nonzero(at & (t['clipcov_allowed'] > 0)).reshape(-1)\n"
    "        size = min(max(int(knobs.param('clip_cov_ratio') * float(at.sum())), 1), cand.numel())\n"
    "        drawn[cand[torch.randperm(cand.numel(), generator=g)[:size]]] = 1\n"
    "    payloads['clip_cov_mask'] = drawn\n"
    "    tokens = {'clip_cov_mask': drawn}\n"
    "fields = policy_loss_fields(payloads['log_probs'], payloads['old_log_probs'], payloads['advantages'],\n"
    "                            payloads['entropy'], mask, lengths, eps_clip=cfg.eps_clip,\n"
    "                            eps_clip_high=cfg.eps_clip_high, entropy_coef=cfg.entropy_coef, knobs=knobs,\n"
    "                            dtype=torch.float64, rollout_log_probs=payloads.get('rollout_log_probs'),\n"
    "                            family_tokens=tokens)\n"
    "expected['loss.policy'] = {k: float(v) for k, v in fields.items() if k in policy_fields_for(knobs)}\n"
    "write_bundle(sys.argv[1], m, msgspec.structs.replace(index, config=cfg), expected, payloads)\n"
)


def main(argv=None) -> int:
    import json

    args = bundle_args(__doc__.splitlines()[0], argv)
    with workdir(args.keep, "bench-families-") as root:
        small, _, _ = build_bundles(root, args.samples, args.tokens)
        bundles = {}
        for name, (params, extra) in FAMILIES.items():
            path = bundles[name] = root / f"family-{name}"
            if not path.exists():
                subprocess.run([sys.executable, "-c", FAMILY_CODE, str(path), str(args.samples), str(args.tokens),
                                name, json.dumps(params), json.dumps(extra)], check=True)
        payloads = sorted(str(p) for p in (small / "payloads").iterdir())
        print(f"bundles: {args.samples} samples × {args.tokens} tokens, {len(payloads)} payloads")
        cmds = {"floor": [sys.executable, "-c", FLOOR_CODE, *payloads], "replay ppo": cli_cmd("replay") + [str(small)]}
        cmds.update({f"replay {name}": cli_cmd("replay") + [str(path)] for name, path in bundles.items()})
        med, med_cpu, _ = measure(cmds, args.reps)
        checks = []
        for name in ["ppo", *FAMILIES]:
            ratio = med[f"replay {name}"] / med["floor"]
            checks.append((f"replay({name}) / floor = {ratio:.2f} wall "
                           f"({med_cpu[f'replay {name}'] / med_cpu['floor']:.2f} cpu) (target ≤ {FLOOR_LIMIT})",
                           ratio <= FLOOR_LIMIT))
        return report(checks)


if __name__ == "__main__":
    sys.exit(main())
