"""The data-parallel hooks of the training loop: joining a torchrun job, the settings it needs,
and the combined step record. `fastgrpo.distributed` is imported only inside a job of more than one
process."""

from __future__ import annotations

import os
from contextlib import contextmanager

from fastgrpo.config import Config, ConfigError
from fastgrpo.models.sources import resolve_device


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
    prompts, minis = config.rollout.prompts_per_step, config.train.mini_batches
    if prompts % (ranks * minis):
        raise ConfigError(
            f"rollout.prompts_per_step={prompts} must be a multiple of the {ranks} processes x "
            f"train.mini_batches={minis}, so that every rank holds whole prompt groups of each "
            f"mini-batch; e.g. --set rollout.prompts_per_step={ranks * minis * max(1, prompts // (ranks * minis))}"
        )


def choose_parallel(config: Config, model, world) -> tuple[bool, str]:
    """(shard the optimizer state?, the line that says what was chosen, with the estimated bytes
    per process of weights, gradients and optimizer state) for a data-parallel job.

    auto shards: sharded state moves as many bytes as replicated (a reduce-scatter and an
    all-gather make one all-reduce) and AdamW steps 1/N of it, so it measured both faster and
    smaller (4 x H200, 0.5B: 0.463 s and 11.5 GiB against 0.510 s and 15.6 GiB,
    benchmarks/results/parallel_ab_h200x4.txt), and it is what lets a 7B model train on 4 GPUs.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    count = sum(p.numel() for p in params)
    width = params[0].element_size()
    masters = width < 4 and config.train.master_weights != "off"
    reference = count * width if config.algo.beta else 0  # sharded: 1/N, whole while it scores
    # weights + gradients, the fp32 masters with their fp32 gradients, and AdamW's two moments
    replicated = count * (2 * width + (16 if masters else 2 * width)) + reference
    sharded = count * (2 * width + 16 / world.size) + reference / world.size
    mode = config.train.parallel
    chosen = "sharded" if mode == "auto" else mode
    gib = (sharded if chosen == "sharded" else replicated) / 2**30
    other = (replicated if chosen == "sharded" else sharded) / 2**30
    line = (
        f"data parallel over {world.size} processes: {chosen} optimizer state, ~{gib:.1f} GiB of "
        f"weights, gradients and optimizer state per process (~{other:.1f} GiB "
        f"{'replicated' if chosen == 'sharded' else 'sharded'}; train.parallel={mode})"
    )
    return chosen == "sharded", line


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
