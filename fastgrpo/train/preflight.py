"""`fastgrpo check`: a few real rollouts of a config before a long run, and what they say.

It loads the model, the task and the rewards as `train` would, rolls out `steps` batches of
training prompts (no update), scores them, and reports what decides whether a GRPO run can learn:
the share of groups whose rewards are all equal (no gradient), the share of completions cut off
at `rollout.max_new_tokens`, each reward's failures, the mean reward and accuracy, and the
rollout's tokens per second; then a verdict with advice for each problem found. Before the
rollouts, on a GPU, it predicts the run's peak memory and the longest completion that fits
(`memory_estimate`). Nothing is written.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from fastgrpo.algo import zero_std_fraction
from fastgrpo.config import Config
from fastgrpo.data import PromptSampler
from fastgrpo.data.chat import render_prompt
from fastgrpo.rewards.rollout_rewards import score_rollout
from fastgrpo.rollout import release_engine
from fastgrpo.train.memory_estimate import estimate_memory, longest_completion
from fastgrpo.train.step import sample_completions

# the advice's thresholds
EQUAL_REWARDS_WARN = 0.3
TRUNCATED_WARN = 0.2
FAILURES_WARN = 0.0


@dataclass
class CheckReport:
    steps: int
    completions: int
    equal_reward_groups: float  # share of groups with all-equal rewards
    truncated: float  # share of completions cut off at the length limit
    mean_reward: float
    accuracy: float
    tokens_per_s: float
    mean_length: float
    failures: dict[str, float] = field(default_factory=dict)  # reward -> share of calls failed
    errors: dict[str, str] = field(default_factory=dict)
    advice: list[str] = field(default_factory=list)

    @property
    def ready(self) -> bool:
        return not self.advice

    def lines(self) -> list[str]:
        out = [
            f"rolled out {self.steps} step(s), {self.completions} completions",
            f"  groups with equal rewards (no gradient): {self.equal_reward_groups:.0%}",
            f"  completions cut off at the length limit: {self.truncated:.0%}",
            f"  mean reward {self.mean_reward:.3f}, accuracy {self.accuracy:.3f}, "
            f"mean length {self.mean_length:.1f} tokens",
            f"  rollout: {self.tokens_per_s:,.0f} completion tokens/s",
        ]
        out += [
            f"  reward {n} failed on {share:.0%} of completions"
            for n, share in self.failures.items()
        ]
        if self.ready:
            out.append("verdict: ready to train")
        else:
            out.append(f"verdict: {len(self.advice)} thing(s) to look at before a long run")
            out += [f"  - {text}" for text in self.advice]
        return out


def advise(report: CheckReport, config: Config) -> list[str]:
    """Concrete advice for each problem the rollouts show."""
    out = []
    if report.equal_reward_groups > EQUAL_REWARDS_WARN:
        out.append(
            f"{report.equal_reward_groups:.0%} of groups have equal rewards and teach nothing: "
            "consider algo.dynamic_sampling=true, more rollout.num_generations "
            f"(now {config.rollout.num_generations}), or a task split nearer the model's level"
        )
    if report.truncated > TRUNCATED_WARN:
        out.append(
            f"{report.truncated:.0%} of completions hit rollout.max_new_tokens="
            f"{config.rollout.max_new_tokens}: raise it, or set "
            "algo.mask_truncated_completions=true (or add the overlong_penalty reward)"
        )
    for name, share in report.failures.items():
        if share > FAILURES_WARN:
            error = report.errors.get(name, "")
            out.append(
                f"reward {name} failed on {share:.0%} of completions"
                + (f" (first error: {error})" if error else "")
                + ": fix it before training; failing calls score 0"
            )
    if report.mean_reward == 0 and report.equal_reward_groups == 1:
        out.append(
            "every completion scored 0: check the rewards against a few completions "
            "(`fastgrpo eval --show 5`), or start from an easier task"
        )
    return out


@torch.no_grad()
def check_config(config: Config, model, tokenizer, task, rewards, stop_ids, steps: int = 2):
    """`steps` rollouts of training prompts scored by `rewards`; the report (with advice)."""
    r = config.rollout
    sampler = PromptSampler(len(task.train), r.prompts_per_step, seed=config.train.seed)
    torch.manual_seed(config.train.seed)
    totals, zero_std, truncated, lengths, correct = [], [], [], [], []
    failures: dict[str, int] = {}
    errors: dict[str, str] = {}
    seconds = 0.0
    for _ in range(steps):
        examples = [task.train[i] for i in sampler.next_batch()]
        start = time.perf_counter()
        rollout = sample_completions(config, model, tokenizer, stop_ids, examples)
        seconds += time.perf_counter() - start
        scores = score_rollout(
            rewards, tokenizer, examples, rollout, r.num_generations, r.max_new_tokens
        )
        total = torch.tensor(scores.result.total, dtype=torch.float32)
        totals.append(total)
        zero_std.append(float(zero_std_fraction(total, r.num_generations)))
        truncated += (~rollout.finished.cpu()).tolist()
        lengths += rollout.lengths.cpu().tolist()
        correct += scores.correct
        for name, n in scores.result.failures.items():
            failures[name] = failures.get(name, 0) + n
        for name, text in scores.result.errors.items():
            errors.setdefault(name, text)
    release_engine(model)
    every = torch.cat(totals)
    report = CheckReport(
        steps=steps,
        completions=every.numel(),
        equal_reward_groups=sum(zero_std) / len(zero_std),
        truncated=sum(truncated) / len(truncated),
        mean_reward=float(every.mean()),
        accuracy=sum(correct) / len(correct),
        tokens_per_s=sum(lengths) / max(seconds, 1e-9),
        mean_length=sum(lengths) / len(lengths),
        failures={name: n / every.numel() for name, n in failures.items() if n},
        errors=errors,
    )
    report.advice = advise(report, config)
    return report


PROMPTS_MEASURED = 512  # training prompts whose token counts set the predicted prompt length
H100_BYTES = 85_029_158_912  # what torch reports for an H100 80GB: the CPU's yardstick


def memory_lines(config: Config, model, tokenizer, task, lora=None) -> list[str]:
    """The predicted peak GPU memory of training this config (the longest of the first training
    prompts, every completion at the length limit), whether it fits, and the longest completion
    that would. On a GPU for that GPU; elsewhere for a bf16 run on an 80 GB H100."""
    from fastgrpo.models import Transformer
    from fastgrpo.models.lora import add_adapters

    if not isinstance(model, Transformer):
        return [
            "memory: predicted for fastgrpo's native models only (this one runs through "
            "transformers)"
        ]
    examples = task.train[:PROMPTS_MEASURED]
    texts = [render_prompt(tokenizer, ex.prompt, config.task.system_prompt) for ex in examples]
    prompt_len = max(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"])
    on_gpu = model.device.type == "cuda"
    if on_gpu:
        total = torch.cuda.get_device_properties(model.device).total_memory
    else:
        total = H100_BYTES
    if not on_gpu or lora is not None:  # the same shapes, no storage: only sizes count
        dtype = model.lm_head_weight.dtype if on_gpu else torch.bfloat16  # the CPU: an H100 run
        with torch.device("meta"):
            model = Transformer(model.config).to(dtype)
        model.pack_projections()
    if lora is not None:  # on the copy: the check's rollouts use the model as loaded
        add_adapters(model, lora)  # the trainer adds the same adapters; only their shapes count
    estimate = estimate_memory(config, model, prompt_len, device_bytes=total)
    longest = longest_completion(config, model, prompt_len, total)
    context = model.config.max_position_embeddings - prompt_len
    gpu = "this GPU's" if on_gpu else "an H100 80GB's"
    lines = estimate.lines(total, longest, gpu=gpu, context_limit=context)
    if not on_gpu:
        lines[0] = lines[0].replace("GPU memory:", "GPU memory of a bf16 run on an H100 80GB:")
    return lines
