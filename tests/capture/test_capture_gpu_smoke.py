"""The prepared GPU smoke script: its capture→replay path runs here on the CPU; without CUDA it skips."""

from __future__ import annotations

import torch


def test_smoke_path_passes_with_cpu_tensors(gpu_smoke, capsys):
    assert gpu_smoke.main(["--device", "cpu"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "rollout-0: pass (sample=pass, reward.raw=pass, reward.post_process=pass, advantage.kl=pass, "
        "advantage.estimate=pass)",
        "step-0-0: pass (sample=pass, logprob.support=pass, loss.policy=pass)",
        "gpu smoke on cpu: pass",
    ]


def test_smoke_without_cuda_skips_with_a_clear_message(gpu_smoke, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_smoke.main([]) == 0
    assert capsys.readouterr().out == "skipped: no CUDA (torch.cuda.is_available() is False); nothing was run\n"
