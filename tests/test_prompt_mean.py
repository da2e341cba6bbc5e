"""loss_agg_mode ``prompt_mean`` (SkyRL ``loss_reduction=prompt_mean``): hand-derived weights."""

from __future__ import annotations

import pytest
import torch

from replay_lib.bundle.loss_knobs import LossKnobs, prompt_partition
from replay_lib.bundle.schema import SampleRecord
from replay_lib.kernels.loss import aggregate, agg_weights


def test_each_prompts_token_mean_averaged_over_the_prompts():
    # prompts 7 (samples 0, 2: 3 + 1 tokens) and 4 (samples 1, 3: 2 + 0 tokens); sums 3, 4, 1, 0
    samples = [SampleRecord(sample_id=f"s{i}", group_index=g, response_length=3, total_length=5,
                            loss_mask=[1, 1, 1])
               for i, g in enumerate([7, 4, 7, 4])]
    assert prompt_partition(samples) == (0, 1, 0, 1)
    knobs = LossKnobs(loss_agg_mode="prompt_mean", prompt=prompt_partition(samples))
    counts = torch.tensor([3.0, 2.0, 1.0, 0.0], dtype=torch.float64)
    assert agg_weights("prompt_mean", counts, knobs).tolist() == [1 / 8, 1 / 4, 1 / 8, 1 / 4]
    sums = torch.tensor([3.0, 4.0, 1.0, 0.0], dtype=torch.float64)
    # ((3 + 1)/4 + (4 + 0)/2) / 2 = 1.5
    assert float(aggregate(sums, counts, "prompt_mean", knobs)) == pytest.approx(1.5, rel=1e-15)


def test_without_the_partition_it_says_what_it_needs():
    with pytest.raises(ValueError, match="loss aggregation 'prompt_mean' needs each sample's group_index"):
        agg_weights("prompt_mean", torch.ones(2, dtype=torch.float64), LossKnobs(loss_agg_mode="prompt_mean"))
