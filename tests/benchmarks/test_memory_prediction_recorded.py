"""`fastgrpo check`'s memory prediction against the peaks measured on GPUs and kept in
benchmarks/results/: bench_memory.py's seven workloads (H200) and the longest 7B LoRA completion
(H100, lab/probe_long_lora.py), and the 0.5B step with the update's layers eager and as CUDA
graphs, full fine-tuning and LoRA (H100, bench_step.py --cuda-graphs). The workloads' models are built on the meta device (shapes only),
so a change to the estimate is checked against every recorded peak on the CPU. A failure means the
estimate moved away from what was measured, or the code's memory did and the peaks need measuring
again (bench_memory.py, probe_long_lora.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from benchmarks.bench_memory import BASE, CASES
from benchmarks.bench_rollout import hf_config
from benchmarks.bench_step import step_config
from fastgrpo.models import Transformer
from fastgrpo.models.model_config import ModelConfig
from fastgrpo.train.memory_estimate import estimate_memory
from fastgrpo.train.trainer import attach_adapters, lora_settings

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
BAR = 0.04  # the estimate came within 3.1% of each when they were measured


def json_lines(name: str) -> list[dict]:
    lines = (RESULTS / name).read_text().splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]


def recorded() -> list[tuple[str, dict, float, float]]:
    """(name, bench_step workload, measured peak GiB, the GPU's GiB)."""
    out = []
    memory = json_lines("memory_prediction_h200.json")[-1]
    for name, row in zip(CASES, memory["results"]):
        out.append((name, {**BASE, **CASES[name]}, row["measured_gib"], 139.8))
    probe = json_lines("long_lora_h100.txt")[-1]
    for row in probe["results"]:
        workload = dict(
            BASE, shape="7B", lora=16, gradient_checkpointing=True,
            completion_len=row["completion_len"],
        )  # fmt: skip
        out.append((f"7B LoRA {row['completion_len']} tokens", workload, row["peak_gib"], 79.18))
    for line in json_lines("cuda_graphs_step_h100.json"):  # eager, then the layers as graphs
        for row in line["results"]:
            lora = line["workload"]["lora_rank"] if "LoRA" in row["method"] else 0
            workload = dict(BASE, lora=lora, cuda_graphs=line["workload"]["cuda_graphs"])
            name = f"0.5B {row['method']}, cuda_graphs {workload['cuda_graphs']}"
            out.append((name, workload, row["peak_memory_gib"], 79.18))
    return out


@pytest.mark.parametrize(("name", "workload", "measured", "gpu_gib"), recorded())
def test_the_prediction_is_within_four_percent_of_each_recorded_peak(
    name, workload, measured, gpu_gib
):
    args = argparse.Namespace(**{"cuda_graphs": "off", **workload}, warmup=1, steps=1)
    config = step_config(args)
    with torch.device("meta"):
        model = Transformer(ModelConfig.from_hf(hf_config(args.shape))).to(torch.bfloat16)
    if args.lora:
        config.lora.rank, config.lora.alpha = args.lora, 2.0 * args.lora
        attach_adapters(model, lora_settings(config))  # fp32 adapters, as the trainer's
    estimate = estimate_memory(config, model, args.prompt_len, device_bytes=int(gpu_gib * 2**30))
    predicted = estimate.peak / 2**30
    assert abs(predicted / measured - 1) <= BAR, (name, measured, predicted)
