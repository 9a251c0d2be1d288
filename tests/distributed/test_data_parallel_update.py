"""Data parallel on the CPU (gloo, 2 processes): the same global batch gives the one-process update.

Each rank takes every second prompt group of one synthetic rollout (`World.share`), plans its
mini-batches with the global counts, scores and updates; `ModelOptimizer` sums the gradients over
the ranks. The parameters after two epochs of two mini-batches each must equal those of one
process updating on the whole rollout, in fp32, for the loss types whose normalisers differ.
"""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import LlamaConfig

from fastgrpo.algo import group_advantages
from fastgrpo.distributed import World, sharded
from fastgrpo.distributed.fsdp import FullySharded
from fastgrpo.distributed.sharded import read_one_process_state
from fastgrpo.models.transformer import ModelConfig, Transformer
from fastgrpo.rollout.types import Rollout
from fastgrpo.train.batching import plan_update
from fastgrpo.train.optim import SHARDS_FOLDER, ModelOptimizer
from fastgrpo.train.profiling import PhaseTimer
from fastgrpo.train.scoring import score_old, score_reference
from fastgrpo.train.step_loss import LossSettings, choose_loss
from fastgrpo.train.update import update_policy

PROMPTS, GROUP, VOCAB = 4, 4, 61
LOSSES = [("grpo", 0.0), ("dr_grpo", 0.04), ("dapo", 0.0), ("gspo", 0.04)]


def tiny_models(seed: int = 0) -> tuple[Transformer, Transformer]:
    """(policy, reference): a 2-layer GQA Llama shape in fp32, the reference a perturbed copy."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=False,
    )  # fmt: skip
    policy = Transformer(ModelConfig.from_hf(config))
    reference = copy.deepcopy(policy)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return policy, reference


def global_batch(seed: int = 1) -> tuple[Rollout, torch.Tensor]:
    """A rollout of PROMPTS groups of GROUP rows (left-padded prompts of 3-9 tokens, completions
    of 1-12), and advantages with some zero rows."""
    g = torch.Generator().manual_seed(seed)
    rows, tp, tc = PROMPTS * GROUP, 9, 12
    prompt_ids = torch.zeros(rows, tp, dtype=torch.long)
    prompt_mask = torch.zeros(rows, tp, dtype=torch.long)
    for p in range(PROMPTS):
        n = int(torch.randint(3, tp + 1, (), generator=g))
        ids = torch.randint(1, VOCAB, (n,), generator=g)
        prompt_ids[p * GROUP : (p + 1) * GROUP, tp - n :] = ids
        prompt_mask[p * GROUP : (p + 1) * GROUP, tp - n :] = 1
    lengths = torch.randint(1, tc + 1, (rows,), generator=g)
    completion_mask = (torch.arange(tc) < lengths[:, None]).long()
    completion_ids = torch.randint(1, VOCAB, (rows, tc), generator=g) * completion_mask
    finished = lengths < tc
    sampling_logp = -torch.rand(rows, tc, generator=g) * 3 * completion_mask
    advantages = torch.randn(rows, generator=g)
    advantages[::5] = 0.0
    rollout = Rollout(
        prompt_ids, prompt_mask, completion_ids, completion_mask, finished, sampling_logp
    )
    return rollout, advantages


def uneven_batch() -> tuple[Rollout, torch.Tensor]:
    """`global_batch` with rank 0's first group (group 0) at full length and rank 1's last
    (group 3) of zero advantage: the ranks plan different numbers of micro-batches."""
    rollout, advantages = global_batch()
    rollout.completion_mask[:GROUP] = 1
    rollout.completion_ids[:GROUP] = rollout.completion_ids[:GROUP].clamp(min=1)
    rollout.finished[:GROUP] = False
    advantages[3 * GROUP :] = 0.0
    return rollout, advantages


def run_update(
    loss_type: str,
    beta: float,
    world: World | None,
    sharded: bool = False,
    shards=None,
    *,
    batch: tuple[Rollout, torch.Tensor] | None = None,
    token_budget: int = 40,
    fsdp: bool = False,
    dtype: torch.dtype = torch.float32,
) -> dict:
    """Two epochs over two mini-batches on this process's share of the global batch (`batch`,
    else `global_batch()`): the gradients AdamW stepped with (summed over the ranks) at each of
    the 4 steps (not recorded when `sharded`: AdamW then steps each rank's shard), the parameters
    after, the optimizer's state (`sharded`: its description, the shards written to the folder
    `shards`), and the completion tokens of each micro-batch of each mini-batch."""
    policy, reference = (m.to(dtype) for m in tiny_models())  # bf16: fp32 masters step
    rollout, advantages = global_batch() if batch is None else batch
    if world is not None:  # this rank's prompt groups, whole
        groups = world.share(list(range(PROMPTS)))
        rows = [p * GROUP + i for p, i in itertools.product(groups, range(GROUP))]
        rollout, advantages = rollout.rows(rows), advantages[rows]
    settings = LossSettings(
        loss_type=loss_type, beta=beta, kl_estimator="k3", epsilon_low=0.2, epsilon_high=0.28,
        delta=None, importance_sampling_level="sequence" if loss_type == "gspo" else "token",
        max_completion_length=12, entropy_coef=0.0, importance_sampling_cap=2.0, temperature=1.0,
    )  # fmt: skip
    plan = plan_update(
        rollout,
        advantages,
        mini_batches=2,
        token_budget=token_budget,  # 40: several micro-batches per mini-batch
        zero_gradient_rows=settings.zero_gradient_rows_possible,
        packed=True,
        world=world,
        lockstep=fsdp,
    )
    fully_sharded = FullySharded(policy, world) if fsdp else None
    if beta:
        score_reference(reference, plan, temperature=1.0, token_budget=40, fused=False)
    score_old(policy, plan, temperature=1.0, fused=False)
    optimizer = ModelOptimizer(
        policy, learning_rate=1e-3, weight_decay=0.01, betas=(0.9, 0.99), eps=1e-8, world=world,
        sharded=sharded, fully_sharded=fully_sharded,
    )  # fmt: skip
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer.adamw, lambda step: 1.0)
    grads, adamw_step = [], optimizer.adamw.step

    def recorded_step(*args, **kwargs):
        grads.append(torch.cat([p.grad.flatten() for p in optimizer._stepped]))
        return adamw_step(*args, **kwargs)

    if not sharded and not fsdp:
        optimizer.adamw.step = recorded_step
    update_policy(
        policy,
        optimizer,
        scheduler,
        plan,
        choose_loss(settings, fused=False),
        num_iterations=2,
        max_grad_norm=1.0,
        timer=PhaseTimer(torch.device("cpu")),
    )
    state = optimizer.state_dict()
    if sharded and shards is not None:  # every rank writes its pieces of masters and moments
        if world.is_main:
            shards.mkdir(parents=True, exist_ok=True)  # as rank 0's checkpoint folder is
        optimizer.save_shards(shards if world.is_main else None)
        state["shards"] = str(shards / SHARDS_FOLDER)
    if fsdp:  # the engine's whole copy, gathered from the shards after the last step
        policy = fully_sharded.rollout_model
    return {
        "grads": grads,
        "idle_passes": [mini.idle_passes for mini in plan],
        "params": [p.detach().clone() for p in policy.parameters()],
        "state": state,
        "tokens": [[int(mb.rollout.completion_mask.sum()) for mb in mini.micro] for mini in plan],
    }


def _rank_main(rank: int, size: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
    try:
        world = World(rank, size)
        results = {f"{t}-{b}": run_update(t, b, world) for t, b in LOSSES}
        sharded.BUCKET_ELEMENTS = 1000  # many buckets; some parameters larger than one
        for t, b in LOSSES:
            shards = Path(out).parent / f"shards-{t}-{b}"
            results[f"sharded-{t}-{b}"] = run_update(t, b, world, True, shards)
            results[f"fsdp-{t}-{b}"] = run_update(t, b, world, batch=uneven_batch(), fsdp=True)
            results[f"fsdp-{t}-{b}"]["idle_passes"] = world.gather(
                results[f"fsdp-{t}-{b}"]["idle_passes"]
            )
        rewards = world.share(list(torch.arange(8.0).pow(1.5).split(2)))  # groups of 2
        results["batch_std"] = world.batch_std(torch.cat(rewards))
        if world.is_main:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()
    skip_teardown()


def skip_teardown() -> None:
    """End a spawned rank that finished its work without the interpreter's teardown, where
    gloo's threads left behind by FSDP can abort the process ("terminate called without an
    active exception"; 1 run in 3 on this CPU)."""
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.fixture(scope="module")
def two_process_results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dp")
    out = folder / "params.pt"
    mp.start_processes(
        _rank_main, args=(2, str(folder / "store"), str(out)), nprocs=2, start_method="spawn"
    )
    return torch.load(out)


@pytest.mark.parametrize(("loss_type", "beta"), LOSSES)
def test_two_processes_give_the_one_process_update_of_the_same_global_batch(
    two_process_results, loss_type, beta
):
    """Gradients within fp32 summation noise at every step (a normaliser off by the number of
    ranks, or a rank's rows in the wrong mini-batch, would be off by tens of percent), and the
    parameters within 1e-6 of their norm. Elementwise the parameters are compared loosely: AdamW
    divides by the root of a gradient's square, so a near-zero gradient that sums in another
    order moves its weight by a different fraction of the learning rate."""
    before = [p.detach() for p in tiny_models()[0].parameters()]
    one = run_update(loss_type, beta, world=None)
    two = two_process_results[f"{loss_type}-{beta}"]
    assert len(one["grads"]) == len(two["grads"]) == 4
    for a, b in zip(one["grads"], two["grads"]):
        assert float((a - b).norm() / a.norm()) < 1e-5
    moved = max(float((a - b).abs().max()) for a, b in zip(one["params"], before))
    assert moved > 1e-4  # the update did something worth comparing
    for a, b in zip(one["params"], two["params"], strict=True):
        assert float((a - b).norm() / a.norm()) < 1e-6
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)


@pytest.mark.parametrize(("loss_type", "beta"), LOSSES)
def test_two_processes_with_sharded_optimizer_state_give_the_one_process_update(
    two_process_results, loss_type, beta
):
    """train.parallel=sharded: each rank steps half of every fp32 master and moment, then the
    ranks gather the weights; the parameters match one process's, and the optimizer state the
    ranks wrote (torch.distributed.checkpoint), read back in the one-process format, matches
    one process's state."""
    one = run_update(loss_type, beta, world=None)
    two = two_process_results[f"sharded-{loss_type}-{beta}"]
    for a, b in zip(one["params"], two["params"], strict=True):
        assert float((a - b).norm() / a.norm()) < 1e-6
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    params = list(tiny_models()[0].parameters())
    read = read_one_process_state(two["state"], params, lambda p: p.dtype != torch.float32)
    mine, theirs = one["state"]["adamw"], read["adamw"]
    assert [g["params"] for g in theirs["param_groups"]] == [
        g["params"] for g in mine["param_groups"]
    ]
    assert [g["weight_decay"] for g in theirs["param_groups"]] == [0.01, 0.0]
    assert theirs["state"].keys() == mine["state"].keys()
    for i, state in mine["state"].items():
        assert float(theirs["state"][i]["step"]) == float(state["step"]) == 4
        for key in ("exp_avg", "exp_avg_sq"):
            a, b = state[key], theirs["state"][i][key]
            assert a.shape == b.shape
            assert float((a - b).norm() / a.norm().clamp(min=1e-30)) < 1e-4, (i, key)


@pytest.mark.parametrize(("loss_type", "beta"), LOSSES)
def test_two_processes_with_fsdp_give_the_one_process_update(two_process_results, loss_type, beta):
    """train.parallel=fsdp: FSDP2 shards the weights, gradients and moments; the ranks run
    different numbers of micro-batches, the less busy one idle passes, and the whole weights
    gathered into the engine's copy match one process's parameters."""
    one = run_update(loss_type, beta, world=None, batch=uneven_batch())
    two = two_process_results[f"fsdp-{loss_type}-{beta}"]
    rank0, rank1 = two["idle_passes"]
    assert any(rank0 + rank1)  # the ranks' micro-batch counts differed somewhere
    assert all(a == 0 or b == 0 for a, b in zip(rank0, rank1))
    for a, b in zip(one["params"], two["params"], strict=True):
        assert float((a - b).norm() / a.norm()) < 1e-6
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)


def test_the_batch_std_of_two_shares_is_the_std_of_the_whole_batch(two_process_results):
    whole = torch.arange(8.0).pow(1.5)
    torch.testing.assert_close(two_process_results["batch_std"], whole.std(), rtol=1e-6, atol=0)


def test_batch_scaled_advantages_divide_by_the_given_std_of_the_whole_batch():
    rewards = torch.tensor([0.0, 1.0, 1.0, 1.0, 2.0, 0.0])
    mine = group_advantages(rewards, 2, scale="batch", batch_std=torch.tensor(4.0), eps=0.0)
    torch.testing.assert_close(mine, group_advantages(rewards, 2, scale="none") / 4.0)
    alone = group_advantages(rewards, 2, scale="batch", eps=0.0)
    torch.testing.assert_close(alone, group_advantages(rewards, 2, scale="none") / rewards.std())


def test_a_rank_share_is_every_nth_group_and_refuses_an_uneven_split():
    assert World(1, 2).share([0, 1, 2, 3]) == [1, 3]
    assert World(0, 4).share(list(range(8))) == [0, 4]
    with pytest.raises(ValueError, match="multiple of the number of processes"):
        World(0, 3).share([0, 1, 2, 3])


def test_ranks_records_combine_as_the_whole_batch_would_show():
    from fastgrpo.distributed.metrics import combine_records

    rank0 = {"reward/mean": 0.5, "completion/min_length": 3, "completion/max_length": 40,
             "time/rollout": 0.2, "tokens_per_s": 1000.0, "reward_failures/fmt": 2, "step": 7}  # fmt: skip
    rank1 = {"reward/mean": 0.25, "completion/min_length": 1, "completion/max_length": 64,
             "time/rollout": 0.3, "tokens_per_s": 900.0, "reward_failures/acc": 8,
             "reward_errors/acc": "ValueError: bad", "step": 7}  # fmt: skip
    assert combine_records([rank0, rank1]) == {
        "reward/mean": 0.375,
        "completion/min_length": 1,
        "completion/max_length": 64,
        "time/rollout": 0.3,
        "time/rollout/per_rank": [0.2, 0.3],
        "tokens_per_s": 1900.0,
        "reward_failures/fmt": 2,
        "reward_failures/acc": 8,
        "reward_errors/acc": "ValueError: bad (on rank 1)",  # the rank that saw it, named
        "step": 7,
    }


def test_auto_shards_the_optimizer_state_and_says_the_bytes_per_process():
    from fastgrpo.config import Config
    from fastgrpo.train.parallel import choose_parallel

    model = torch.nn.Linear(1 << 14, 1 << 14, bias=False, device="meta", dtype=torch.bfloat16)
    config = Config()  # 2^28 bf16 weights with fp32 masters: 20 bytes each, or 2 + 2 + 16 / 4
    chosen, line = choose_parallel(config, model, World(0, 4))
    assert chosen == "sharded"
    assert "4 processes: sharded optimizer state, ~2.0 GiB" in line
    assert "~5.0 GiB replicated" in line and "~1.5 GiB fsdp" in line  # fsdp: 2 + 16 / 4
    config.train.parallel, config.algo.beta = "replicated", 0.04  # + a bf16 reference: 0.5 GiB
    chosen, line = choose_parallel(config, model, World(0, 4))
    assert chosen == "replicated"
    assert "replicated optimizer state, ~5.5 GiB" in line and "~2.1 GiB sharded" in line


def test_fsdp_refuses_what_it_cannot_shard_in_one_line():
    from fastgrpo.config import Config, ConfigError
    from fastgrpo.train.parallel import choose_parallel

    config = Config()
    config.train.parallel = "fsdp"
    policy = tiny_models()[0].to(torch.bfloat16)
    chosen, line = choose_parallel(config, policy, World(0, 2))
    assert chosen == "fsdp" and "fully sharded (FSDP) weights, gradients and optimizer" in line
    with pytest.raises(ConfigError, match="needs fastgrpo's native model"):
        choose_parallel(config, torch.nn.Linear(4, 4), World(0, 2))
    config.train.master_weights = "off"
    with pytest.raises(ConfigError, match="drop train.master_weights=off"):
        choose_parallel(config, policy, World(0, 2))


def _rank_saves_into_an_unseen_folder(rank: int, size: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size)
    try:
        world = World(rank, size)
        policy, _ = tiny_models()
        optimizer = ModelOptimizer(
            policy, learning_rate=1e-3, weight_decay=0.0, betas=(0.9, 0.99), eps=1e-8,
            world=world, sharded=True,
        )  # fmt: skip
        try:  # rank 0 names a folder no rank can see (another machine's, in a multi-node job)
            optimizer.save_shards(Path(out) / "elsewhere" if world.is_main else None)
        except RuntimeError as error:
            Path(out, f"rank{rank}.txt").write_text(str(error))
    finally:
        dist.destroy_process_group()


def test_a_rank_that_cannot_see_the_checkpoint_folder_says_so_instead_of_writing_elsewhere(
    tmp_path,
):
    mp.start_processes(
        _rank_saves_into_an_unseen_folder,
        args=(2, str(tmp_path / "store"), str(tmp_path)),
        nprocs=2,
        start_method="spawn",
    )
    message = (tmp_path / "rank1.txt").read_text()
    assert "rank 1 cannot see" in message and "every machine of the job shares" in message
    assert not (tmp_path / "elsewhere").exists()
