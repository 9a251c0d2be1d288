"""The data-parallel hooks of the training loop: joining a torchrun job, the settings it needs,
and the combined step record. `fastgrpo.distributed` is imported only inside a job of more than one
process."""

from __future__ import annotations

import os
from contextlib import contextmanager

from fastgrpo.config import Config, ConfigError
from fastgrpo.models.sources import resolve_device
from fastgrpo.models.transformer import Transformer


def join_world(config: Config):
    """The data-parallel job this process is a rank of (started by torchrun with more than one
    process), else None; `fastgrpo.distributed` is imported only then."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return None
    check_data_parallel(config, size)  # before any process-group work: every rank says it
    if config.model.device.startswith("cuda:"):
        raise ConfigError(
            f"model.device={config.model.device} under torchrun: each process takes the GPU of "
            "its LOCAL_RANK; set model.device=cuda or auto (CUDA_VISIBLE_DEVICES picks the GPUs)"
        )
    from fastgrpo.distributed import join_torchrun

    return join_torchrun(resolve_device(config.model.device).type)


def check_data_parallel(config: Config, ranks: int) -> None:
    """What a data-parallel job of `ranks` processes needs of the config (every rank checks, so
    a bad setting ends every rank with the same one-line error)."""
    if config.algo.dynamic_sampling:
        raise ConfigError(
            "algo.dynamic_sampling runs in one process for now (the ranks would keep different "
            "groups); turn it off for a data-parallel job"
        )
    prompts, minis = config.rollout.prompts_per_step, config.train.mini_batches
    if prompts % (ranks * minis):
        raise ConfigError(
            f"rollout.prompts_per_step={prompts} must be a multiple of the {ranks} processes x "
            f"train.mini_batches={minis}, so that every rank holds whole prompt groups of each "
            f"mini-batch; e.g. --set rollout.prompts_per_step={ranks * minis * max(1, prompts // (ranks * minis))}"
        )


def choose_parallel(config: Config, model, world) -> tuple[str, str]:
    """(replicated, sharded or fsdp; the line that says what was chosen, with the estimated
    bytes per process of weights, gradients and optimizer state) for a data-parallel job.

    auto shards the optimizer state: sharded state moves as many bytes as replicated (a
    reduce-scatter and an all-gather make one all-reduce) and AdamW steps 1/N of it, so it
    measured both faster and smaller (4 x H200, 0.5B: 0.463 s and 11.5 GiB against 0.510 s and
    15.6 GiB, benchmarks/results/parallel_ab_h200x4.txt). Where that state would take more than
    half of the GPU, auto shards the weights and gradients too (FSDP).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    count = sum(p.numel() for p in params)
    width = params[0].element_size()
    masters = width < 4 and config.train.master_weights != "off"
    reference = count * width if config.algo.beta else 0  # sharded: 1/N, whole while it scores
    n = world.size
    # weights + gradients, the fp32 masters with their fp32 gradients, and AdamW's two moments;
    # fsdp: the engine's whole copy, and fp32 weights, gradients and moments in shards
    estimate = {
        "replicated": count * (2 * width + (16 if masters else 2 * width)) + reference,
        "sharded": count * (2 * width + 16 / n) + reference / n,
        "fsdp": count * (width + 16 / n) + reference / n,
    }
    mode = config.train.parallel
    chosen = mode
    if mode == "auto":
        room = _device_bytes(model)
        too_big = room is not None and estimate["sharded"] > room / 2
        chosen = "fsdp" if too_big and isinstance(model, Transformer) else "sharded"
    if chosen == "fsdp":
        check_fully_sharded(config, model)
    others = ", ".join(f"~{estimate[k] / 2**30:.1f} GiB {k}" for k in estimate if k != chosen)
    words = {"fsdp": "fully sharded (FSDP) weights, gradients and"}.get(chosen, chosen)
    line = (
        f"data parallel over {n} processes: {words} optimizer state, "
        f"~{estimate[chosen] / 2**30:.1f} GiB of weights, gradients and optimizer state per "
        f"process ({others}; train.parallel={mode})"
    )
    return chosen, line


def _device_bytes(model) -> int | None:
    device = next(model.parameters()).device
    if device.type != "cuda":
        return None
    import torch

    return torch.cuda.get_device_properties(device).total_memory


def check_fully_sharded(config: Config, model) -> None:
    """What train.parallel=fsdp needs: the native model, and fp32 masters (FSDP's shards)."""
    if not isinstance(model, Transformer):
        raise ConfigError(
            f"train.parallel=fsdp needs fastgrpo's native model; {type(model).__name__} (the "
            "transformers backend) trains with train.parallel=sharded or replicated"
        )
    if config.train.master_weights == "off":
        raise ConfigError(
            "train.parallel=fsdp keeps fp32 master weights (they are what FSDP shards); drop "
            "train.master_weights=off, or use train.parallel=sharded"
        )


@contextmanager
def local_main_first(world):
    """Run the body on each machine's local rank 0 first, then on its other ranks: a model that
    needs converting or downloading into the machine's cache is fetched once, not by every rank
    at the same time (transformers also writes no weights on ranks other than 0). A no-op for
    one process."""
    if world is not None and world.local_rank != 0:
        world.barrier()
    yield
    if world is not None and world.local_rank == 0:
        world.barrier()


def gather_record(record: dict, world) -> dict:
    from fastgrpo.distributed.metrics import gather_record as gather

    return gather(record, world)


def gather_eval_scores(scores: dict, world) -> dict:
    """The whole evaluation set's scores from every rank's scores of its share."""
    from fastgrpo.distributed.metrics import combine_eval_scores

    return combine_eval_scores(world.gather(scores))
