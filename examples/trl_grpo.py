"""TRL's own GRPOTrainer for a few steps on the CPU, captured into replay bundles.

Nothing here computes a reward normalization, an advantage or a loss: TRL does (``trl.GRPOTrainer``, the
version the ``[trl]`` extra pins), and ``capture.integrations.trl`` records what it computed. So the replay's
expected values are TRL's, not ours.

* Model: a randomly initialised 2-layer GPT-2 (``GPT2LMHeadModel(GPT2Config(...))``, 32-wide), no downloads.
* Tokenizer: a ``tokenizers`` WordLevel vocabulary of the ten digits and three specials, wrapped in
  ``PreTrainedTokenizerFast`` (left padding, as TRL requires).
* Data: ``datasets.Dataset.from_dict`` of digit prompts (``"3 1 4"``).
* Rewards: two Python functions, weighted 1.0 and 0.5: the number of odd digits in the completion, and a
  bonus for ending with ``<eos>`` within the length limit.
* ``GRPOConfig(use_cpu=True, report_to=[])``: 4 completions per prompt, 2 prompts per generation batch,
  micro-batches of 4 with 2 gradient-accumulation steps, each generation trained for ``--iterations`` passes
  (2 by default, so the second pass has a ratio ≠ 1 and TRL computes the old log-probs).

Bugs (``--bug``), each a subclass of the capturing trainer that changes TRL's data where a real bug would:

* ``batch-normalized-rewards``: the reward functions' scores are normalized over the whole generation batch
  (``(r − mean) / std`` per function) before TRL's group normalization sees them. First divergence:
  ``reward.raw`` of the rollout bundles — the rewards TRL normalized are not the scores the reward functions
  returned; TRL's normalization of what it was given is right, so ``reward.post_process`` passes.
* ``shuffled-advantages``: each micro-batch's advantages are rolled by one sample before the loss sees them
  (advantages handed to the wrong samples). The rollout bundles replay clean; in every step bundle the first
  divergence is ``advantage.estimate`` — the advantages the loss consumed are not the samples' normalized
  rewards — while ``loss.policy``, recomputed on what the loss consumed, passes.
* ``kl-no-grad`` (needs ``--beta``): the KL term computed without a gradient (SkyRL#1353's class): the reference
  log-probs TRL reads are ``ref + (logp − logp.detach())``, the same values bit for bit, so the KL term's value is
  TRL's and its gradient 0. With ``RELAX_REPLAY_CAPTURE_GRAD=1`` the step bundles record ``grad_log_probs``: from
  the first step whose policy has left its reference, the first divergence is ``loss.grad`` (explained as "the KL
  term contributes no gradient") while ``loss.policy`` passes.

    RELAX_REPLAY_CAPTURE=1 RELAX_REPLAY_CAPTURE_DIR=/tmp/trl-bundles python examples/trl_grpo.py
    trajectory-replay scan /tmp/trl-bundles
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from capture.integrations.trl import ReplayGRPOTrainer  # noqa: E402

SPECIALS = ["<pad>", "<eos>", "<unk>"]
DIGITS = [str(d) for d in range(10)]
BUGS = ("batch-normalized-rewards", "shuffled-advantages", "kl-no-grad")


def make_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(SPECIALS + DIGITS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                        unk_token="<unk>")
    tokenizer.padding_side = "left"
    return tokenizer


def make_model(tokenizer: PreTrainedTokenizerFast, seed: int) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=32, n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id)
    return GPT2LMHeadModel(config)


def make_dataset(count: int, seed: int) -> Dataset:
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(count):
        n = int(torch.randint(2, 4, (1,), generator=gen))
        prompts.append(" ".join(DIGITS[int(d)] for d in torch.randint(0, 10, (n,), generator=gen)))
    return Dataset.from_dict({"prompt": prompts})


def odd_digits(completions, **_kwargs) -> list[float]:
    """Number of odd digits in the completion."""
    return [float(sum(1 for w in c.split() if w in ("1", "3", "5", "7", "9"))) for c in completions]


def ends_cleanly(completions, completion_ids, **_kwargs) -> list[float]:
    """1 when the completion ended with <eos> (before the length limit), else 0."""
    eos = make_tokenizer().eos_token_id
    return [1.0 if ids and ids[-1] == eos else 0.0 for ids in completion_ids]


class BatchNormalizedRewards(ReplayGRPOTrainer):
    """Bug: every reward function's scores normalized over the whole generation batch before TRL's group
    normalization sees them."""

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        scores = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        return (scores - scores.mean(0)) / (scores.std(0) + 1e-6)


class ShuffledAdvantages(ReplayGRPOTrainer):
    """Bug: each micro-batch's advantages rolled by one sample (handed to the wrong samples)."""

    def _prepare_inputs(self, generation_batch):
        inputs = super()._prepare_inputs(generation_batch)
        if self.model.training:
            inputs = {**inputs, "advantages": inputs["advantages"].roll(1, 0)}
        return inputs


class KLWithoutGradient(ReplayGRPOTrainer):
    """Bug: the KL term of the loss has no gradient (its value unchanged): the reference log-probs the loss reads
    are shifted by ``logp − logp.detach()`` (0), which cancels the KL term's dependence on ``logp``."""

    def _compute_loss(self, model, inputs):
        self._kl_inputs = inputs  # the dict TRL's loss reads the reference log-probs from
        ref = inputs.get("ref_per_token_logps")
        try:
            return super()._compute_loss(model, inputs)
        finally:
            if ref is not None:
                inputs["ref_per_token_logps"] = ref  # what capture records: the reference as it was
            self._kl_inputs = None

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        inputs = getattr(self, "_kl_inputs", None)
        if inputs is not None and inputs.get("ref_per_token_logps") is not None and out[0].requires_grad:
            logps = out[0]
            inputs["ref_per_token_logps"] = inputs["ref_per_token_logps"] + (logps - logps.detach())
        return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4, help="optimizer steps (default 4)")
    p.add_argument("--iterations", type=int, default=2, help="passes over each generation batch (num_iterations)")
    p.add_argument("--loss-type", default="dapo", choices=("dapo", "grpo", "bnpo", "dr_grpo", "cispo", "sapo"))
    p.add_argument("--beta", type=float, default=0.0, help="KL coefficient (a reference model when != 0)")
    p.add_argument("--bias-correction-kl", action="store_true",
                   help="use_bias_correction_kl (TRL's default; off here unless given): the KL × the ratio")
    p.add_argument("--delta", type=float, default=None, help="two-sided clipping: cap the unclipped ratio at delta")
    p.add_argument("--entropy-coef", type=float, default=0.0, help="entropy bonus coefficient")
    p.add_argument("--scale-rewards", default="group", choices=("group", "batch", "none"))
    p.add_argument("--gradient-accumulation", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bug", choices=BUGS, default=None)
    return p.parse_args(argv)


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 of the trained weights (name, dtype, shape and bytes of every tensor, in name order)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}:{t.dtype}:{list(t.shape)}".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def train(argv=None) -> dict:
    """Train once; returns what it did: seconds, the weights' digest, and the capture's counts (``None`` when
    capture is off)."""
    args = parse_args(argv)
    tokenizer = make_tokenizer()
    trainer_class = {None: ReplayGRPOTrainer, "batch-normalized-rewards": BatchNormalizedRewards,
                     "shuffled-advantages": ShuffledAdvantages, "kl-no-grad": KLWithoutGradient}[args.bug]
    if args.bug == "kl-no-grad" and args.beta == 0:
        raise SystemExit("trl_grpo.py: --bug kl-no-grad needs --beta != 0 (a KL term in the loss)")
    with tempfile.TemporaryDirectory(prefix="trl-grpo-") as output_dir:
        config = GRPOConfig(
            output_dir=output_dir, use_cpu=True, report_to=[], seed=args.seed, disable_tqdm=True,
            save_strategy="no", logging_steps=1, max_steps=args.steps, learning_rate=0.05,
            per_device_train_batch_size=4, gradient_accumulation_steps=args.gradient_accumulation,
            num_generations=4, max_completion_length=6, num_iterations=args.iterations,
            loss_type=args.loss_type, beta=args.beta, use_bias_correction_kl=args.bias_correction_kl,
            delta=args.delta, entropy_coef=args.entropy_coef,
            scale_rewards=args.scale_rewards, epsilon=0.2, epsilon_high=0.28, reward_weights=[1.0, 0.5],
            dataloader_num_workers=0,
        )
        model = make_model(tokenizer, args.seed)
        if args.beta != 0:  # TRL builds the reference model from the policy's path: a local copy, no download
            model.save_pretrained(Path(output_dir) / "initial-model")
            model = str(Path(output_dir) / "initial-model")
        trainer = trainer_class(model=model, reward_funcs=[odd_digits, ends_cleanly],
                                args=config, train_dataset=make_dataset(64, args.seed), processing_class=tokenizer)
        started = time.perf_counter()
        trainer.train()
        took = time.perf_counter() - started
    out = {"steps": args.steps, "seconds": took, "weights_sha256": weights_digest(trainer.model), "capture": None}
    hooks = trainer.replay_capture
    if hooks is not None:
        stats = hooks.capture.stats
        out["capture"] = {"directory": str(hooks.capture.config.directory), "written": stats.written,
                          "dropped": stats.dropped, "errors": stats.errors + hooks.errors}
    return out


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    done = train(argv)
    head = f"trained {done['steps']} step(s) in {done['seconds']:.1f} s (weights sha256 {done['weights_sha256'][:16]})"
    captured = done["capture"]
    if captured is None:
        print(f"{head}; capture off (set RELAX_REPLAY_CAPTURE=1 and RELAX_REPLAY_CAPTURE_DIR)")
        return 0
    print(f"{head}; {captured['written']} bundle(s) written to {captured['directory']} "
          f"({captured['dropped']} dropped, {captured['errors']} error(s))")
    return 0 if captured["errors"] == 0 and captured["dropped"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
