"""The `fastgrpo` command: parses arguments, then calls the library. Nothing else lives here."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from pathlib import Path

import yaml

from fastgrpo import switches
from fastgrpo.errors import RunStopped, UserError

DESCRIPTION = """\
Train language models with GRPO-family reinforcement learning.

commands:
  train    run GRPO training (no CONFIG: the CPU quick start, SmolLM2-135M on arithmetic)
  eval     accuracy and mean reward of a model or checkpoint on a task split
  config   print the resolved configuration, or every valid key (--keys)
  export   write a run's model as one Hugging Face folder (LoRA adapters merged)
  push     upload a run's final model and a model card to the Hugging Face Hub
  check    predict a config's GPU memory, roll out a few batches, say whether it can learn
  plot     draw a run's metrics as PNGs

examples:
  fastgrpo train
  fastgrpo train configs/gsm8k.yaml --set algo.beta=0.0 --set rollout.num_generations=8
  fastgrpo train --resume runs/default
  fastgrpo train --profile 2           # Chrome trace of steps 2-3 in runs/default/profile/
  fastgrpo eval --model runs/default --num 200
  fastgrpo config configs/gsm8k.yaml --set train.steps=10
"""


def _add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "config", nargs="?", help="YAML preset (see configs/); omit for the defaults"
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one setting, e.g. --set algo.beta=0.0 (repeatable)",
    )


def _add_trust_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trust-run-code",
        action="store_true",
        help="run the code a run folder's config.yaml names (reward files, "
        "model.trust_remote_code) and load trainer states of older fastgrpo versions",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fastgrpo",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=_version())
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    train = commands.add_parser(
        "train",
        help="run GRPO training",
        description="Run GRPO training. Writes config.yaml, metrics.jsonl and "
        "checkpoints/ into run.output_dir. Ctrl-C or SIGTERM saves a checkpoint and exits.",
    )
    _add_config_arguments(train)
    train.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its latest checkpoint with its config.yaml; --set "
        "may change steps, learning rate and schedule, eval, saving and logging (logged to "
        "RUN_DIR/config_changes.jsonl), not the model, task, rewards, algorithm or batch shape",
    )
    _add_trust_argument(train)
    train.add_argument("--output-dir", help="shorthand for --set run.output_dir=DIR")
    train.add_argument(
        "--nproc",
        type=int,
        metavar="N",
        help="train on N GPUs (or CPU processes) of this machine, data parallel: shorthand for "
        "`torchrun --standalone --nproc-per-node N -m fastgrpo train ...`; "
        "rollout.prompts_per_step stays the global batch; Ctrl-C reaches the ranks, which finish "
        "or drop the step and save (once more: stop at once)",
    )
    train.add_argument(
        "--profile",
        type=int,
        metavar="N",
        help="record N training steps (after the first, which warms up) with torch.profiler and "
        "write a Chrome trace to RUN_DIR/profile/; shorthand for --set run.profile_steps=N",
    )

    evaluate = commands.add_parser(
        "eval",
        help="evaluate a model or checkpoint",
        description="Accuracy and mean reward of a model on a task split, with the task, "
        "rewards and sampling settings of CONFIG; a run or checkpoint folder given as --model "
        "brings its own config.yaml, which CONFIG and --set then override.",
    )
    _add_config_arguments(evaluate)
    evaluate.add_argument(
        "--model",
        help="model name, hub id, directory, .gguf file, checkpoint or run folder "
        "(default: model.name of the config)",
    )
    _add_trust_argument(evaluate)
    evaluate.add_argument(
        "--split", choices=("eval", "train"), default="eval", help="task split (default: eval)"
    )
    evaluate.add_argument("--num", type=int, help="number of problems (default: eval.num_problems)")
    evaluate.add_argument(
        "--temperature", type=float, help="0 for greedy (default: eval.temperature)"
    )
    evaluate.add_argument(
        "--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: off)"
    )
    evaluate.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    evaluate.add_argument(
        "--max-new-tokens", type=int, help="default: eval.max_new_tokens or rollout.max_new_tokens"
    )
    evaluate.add_argument(
        "--show", type=int, default=0, metavar="N", help="print N sample completions"
    )

    config = commands.add_parser(
        "config",
        help="print the resolved configuration",
        description="Print the configuration CONFIG and --set give, as YAML.",
    )
    _add_config_arguments(config)
    config.add_argument(
        "--keys",
        action="store_true",
        help="list every valid key with its type, default and meaning instead",
    )
    plot = commands.add_parser(
        "plot",
        help="draw a run's metrics as PNGs",
        description="Write RUN_DIR/plots/by_step.png and by_time.png: reward and accuracy, "
        "completion length and truncation, KL and entropy, clip fractions, seconds per phase "
        "(needs matplotlib). A run writes them at its end too (run.plots).",
    )
    plot.add_argument("run_dir", metavar="RUN_DIR", help="a run folder (holds metrics.jsonl)")
    check = commands.add_parser(
        "check",
        help="predict a config's GPU memory, roll out a few batches, say whether it can learn",
        description="Pre-flight check: load the model, task and rewards of CONFIG as train does, "
        "predict the run's peak GPU memory part by part and the longest completion that fits "
        "(without a GPU: for a bf16 run on an H100 80GB), roll out --steps batches of training "
        "prompts (no update, nothing written) and report the share of groups with equal "
        "rewards, of completions cut off, reward failures, the mean reward and accuracy, and "
        "tokens/s; then a verdict with advice. Exit code 0 when nothing needs a look, 1 when the "
        "advice lists something.",
    )
    _add_config_arguments(check)
    check.add_argument("--steps", type=int, default=2, help="batches to roll out (default 2)")
    push = commands.add_parser(
        "push",
        help="upload a run's final model and a model card to the Hugging Face Hub",
        description="Upload the newest checkpoint's model (or LoRA adapter), the run's "
        "metrics.jsonl and a model card written from the run to ORG/NAME on the Hub (made if "
        "missing). Needs network and a token (huggingface-cli login or HF_TOKEN); without them "
        "it says so and changes nothing.",
    )
    push.add_argument("run_dir", metavar="RUN_DIR", help="a run folder")
    push.add_argument("repo_id", metavar="ORG/NAME", help="the Hub repository")
    push.add_argument("--private", action="store_true", help="make a new repository private")
    export = commands.add_parser(
        "export",
        help="write a run's model as one Hugging Face folder (LoRA adapters merged)",
        description="Write the model of a run (its latest checkpoint), a checkpoint, or a peft "
        "LoRA adapter folder as one Hugging Face model folder with its tokenizer; a LoRA "
        "adapter is merged into its base model's weights.",
    )
    export.add_argument(
        "source", metavar="SOURCE", help="a run, checkpoint or peft LoRA adapter folder"
    )
    export.add_argument("out", metavar="OUT_DIR", help="the folder to write (new or empty)")
    export.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="the written weights' dtype (default: bfloat16)",
    )
    return parser


def _version() -> str:
    from fastgrpo import __version__

    return f"fastgrpo {__version__}"


def entry() -> int:
    """The `fastgrpo` program (console script and `python -m fastgrpo`): `main`, then, in a rank
    of a torchrun job, the process's end without the interpreter's teardown
    (`distributed.world.end_rank_process`)."""
    code = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from fastgrpo.distributed.world import end_rank_process

        end_rank_process(code)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as given, for --nproc
    if args.command is None:
        parser.print_help()
        return 0
    tag = _rank_tag()
    logging.basicConfig(level=logging.WARNING, format=f"{tag}%(levelname)s %(name)s: %(message)s")
    try:
        commands = {
            "train": run_train,
            "eval": run_eval,
            "config": run_config,
            "plot": run_plot,
            "export": run_export,
            "push": run_push,
            "check": run_check,
        }
        return commands[args.command](args)
    except (UserError, RunStopped) as error:
        if switches.debug():
            raise
        print(f"{tag}error: {_one_line(error)}", file=sys.stderr)
        return 2 if isinstance(error, UserError) else 1
    except BrokenPipeError:  # the reader went away (`fastgrpo config --keys | head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return 0
    except KeyboardInterrupt as stop:  # Ctrl-C or SIGTERM where no step could finish first
        number = getattr(stop, "signum", signal.SIGINT)
        detail = getattr(stop, "detail", "")
        print(
            f"{tag}interrupted ({signal.Signals(number).name}){': ' + detail if detail else ''}",
            file=sys.stderr,
        )
        return _stopped_code(number)


def _stopped_code(number: int) -> int:
    """The exit code of a command a stop signal ended: 128 + the signal's number (the shells'
    convention); 0 in a rank whose stop `fastgrpo train --nproc` relayed, the launcher returning
    that code itself (torchrun would call a rank's non-zero exit a failure, in a page of
    traceback)."""
    return 0 if switches.stop_relayed_by_launcher() else 128 + number


def run_check(args) -> int:
    from fastgrpo.config import ConfigError
    from fastgrpo.models import stop_token_ids
    from fastgrpo.train.preflight import check_config, memory_lines
    from fastgrpo.train.trainer import (
        build_rewards,
        build_task_data,
        load_configured_model,
        lora_settings,
    )

    if args.steps < 1:
        raise ConfigError(f"--steps {args.steps}: give 1 or more batches to roll out")
    config = _load(args)
    task = build_task_data(config)
    rewards = build_rewards(config)
    model, tokenizer, _ = load_configured_model(config)
    stops = stop_token_ids(tokenizer, model)
    print("\n".join(memory_lines(config, model, tokenizer, task, lora_settings(config))))
    report = check_config(config, model, tokenizer, task, rewards, stops, steps=args.steps)
    print("\n".join(report.lines()))
    return 0 if report.ready else 1


def run_push(args) -> int:
    from fastgrpo.train.hub import push

    print(f"uploaded {push(args.run_dir, args.repo_id, private=args.private)}")
    return 0


def run_export(args) -> int:
    from fastgrpo.models import Transformer, load_model, save_native_model

    source, out = Path(args.source), Path(args.out)
    if not source.is_dir():
        raise UserError(f"{source} is not a folder; give a run, checkpoint or adapter folder")
    if out.exists() and any(out.iterdir()):
        raise UserError(f"{out} is not empty; give a new or empty folder to write the model to")
    checkpoint = _checkpoint_in(source)
    folder = source if checkpoint is None else checkpoint / "model"
    model, tokenizer, described = load_model(str(folder), dtype=args.dtype, device="cpu")
    if isinstance(model, Transformer):
        save_native_model(model, out)
    else:
        model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"wrote {out} ({described.description}, {args.dtype})")
    return 0


def _checkpoint_in(folder: Path) -> Path | None:
    """The checkpoint a folder names: a run folder's newest, a checkpoint folder itself, or the
    one whose model/ folder it is; None for any other folder."""
    from fastgrpo.train.checkpoint import STATE_FILE, latest_checkpoint

    if (folder.parent / STATE_FILE).is_file():  # the model/ folder of a checkpoint
        folder = folder.parent
    return folder if (folder / STATE_FILE).is_file() else latest_checkpoint(folder)


def run_plot(args) -> int:
    from fastgrpo.train.plots import plot_run

    for path in plot_run(args.run_dir):
        print(f"wrote {path}")
    return 0


def _rank_tag() -> str:
    """The tag "[rankN]: " in a rank of a torchrun job of several processes, whose lines share
    one stderr (torch tags a rank's uncaught traceback the same way), else ""."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return f"[rank{os.environ.get('RANK', '?')}]: "
    return ""


def _one_line(error: Exception) -> str:
    """The message on one line (a YAML or JSON parser's own message may span several)."""
    return " ".join(str(error).split())


def _load(args):
    from fastgrpo.config import load_config

    return load_config(args.config, args.overrides)


def run_config(args) -> int:
    from fastgrpo.config_keys import format_key_table

    if args.keys:
        print(format_key_table())
        return 0
    print(yaml.safe_dump(_load(args).to_dict(), sort_keys=False), end="")
    return 0


def run_train(args) -> int:
    from fastgrpo.config import ConfigError

    if args.nproc is not None:
        from fastgrpo.launch import run_under_torchrun

        return run_under_torchrun(args.nproc, args.argv)
    from fastgrpo.train import load_resume_config, run_training

    if args.output_dir:
        args.overrides.append(f"run.output_dir={args.output_dir}")
    if args.profile is not None:
        args.overrides.append(f"run.profile_steps={args.profile}")
    if args.resume:
        if args.config:
            raise ConfigError(
                "--resume uses the run folder's own config.yaml; drop the CONFIG argument"
            )
        config = load_resume_config(args.resume, args.overrides, trust_run_code=args.trust_run_code)
    else:
        config = _load(args)  # the overrides are applied here
    result = run_training(config, resume=bool(args.resume), trust_run_code=args.trust_run_code)
    if os.environ.get("RANK", "0") != "0":  # a data-parallel job: rank 0 reports it
        return _stopped_code(result.stop_signal or signal.SIGTERM) if result.interrupted else 0
    before, after = result.eval_before, result.eval_after
    print(
        f"run folder: {result.run_dir} ({result.steps} steps{', interrupted' if result.interrupted else ''})"
    )
    if result.finished_before:
        print(
            f"the run has finished all {result.steps} steps: nothing to do; to train on, raise "
            f"train.steps, e.g. --set train.steps={result.steps + 10}"
        )
    if before and after:
        print(
            f"held-out accuracy: {before['accuracy']:.3f} before -> {after['accuracy']:.3f} after "
            f"({after['num_problems']} problems, seed {config.train.seed})"
        )
    summary = {
        "run_dir": str(result.run_dir),
        "steps": result.steps,
        "interrupted": result.interrupted,
        "accuracy_before": before and before["accuracy"],
        "accuracy_after": after and after["accuracy"],
    }
    print(json.dumps(summary))
    return _stopped_code(result.stop_signal) if result.interrupted else 0


# eval's flags -> the config key whose range each one has
EVAL_FLAGS = {
    "num": "eval.num_problems",
    "temperature": "eval.temperature",
    "top_k": "rollout.top_k",
    "top_p": "rollout.top_p",
    "max_new_tokens": "eval.max_new_tokens",
}


def _check_eval_flags(args) -> None:
    from fastgrpo.config import RANGES, ConfigError, describe_range, in_range

    for name, key in EVAL_FLAGS.items():
        value = getattr(args, name)
        if value is not None and not in_range(value, RANGES[key]):
            flag = "--" + name.replace("_", "-")
            raise ConfigError(
                f"{flag} is {value}; it must be {describe_range(RANGES[key])} (as {key})."
            )


def run_eval(args) -> int:
    from fastgrpo.models import stop_token_ids
    from fastgrpo.train.evaluate import evaluate
    from fastgrpo.train.trainer import build_rewards, build_task_data, load_configured_model

    _check_eval_flags(args)
    name = args.model
    checkpoint = _checkpoint_in(Path(name)) if name and Path(name).is_dir() else None
    if checkpoint is not None:  # a run or checkpoint folder: its weights and its settings
        name = str(checkpoint / "model")
        config = _run_config(checkpoint, args)
    else:
        config = _load(args)
        name = name or config.model.name
    model, tokenizer, source = load_configured_model(config, name)
    task = build_task_data(config)
    examples = (task.eval if args.split == "eval" else task.train)[
        : args.num or config.eval.num_problems
    ]
    samples: list = []
    scores = evaluate(
        model,
        tokenizer,
        examples,
        rewards=build_rewards(config),
        stop_ids=stop_token_ids(tokenizer, model),
        system_prompt=config.task.system_prompt,
        temperature=config.eval.temperature if args.temperature is None else args.temperature,
        max_new_tokens=args.max_new_tokens
        or config.eval.max_new_tokens
        or config.rollout.max_new_tokens,
        batch_size=config.eval.batch_size,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=config.train.seed,
        samples=samples,
    )
    for prompt, completion, answer in samples[: args.show]:
        print(f"--- {prompt!r}\n{completion!r}  (reference {answer!r})")
    print(
        f"{source.description}: accuracy {scores['accuracy']:.3f}, mean reward {scores['reward_mean']:.3f} "
        f"on {scores['num_problems']} {config.task.name} {args.split} problems"
    )
    print(json.dumps({"model": name, "task": config.task.name, "split": args.split, **scores}))
    return 0


def _run_config(checkpoint: Path, args):
    """The config a checkpoint was trained with, under CONFIG's keys and --set; the code it names
    is shown, and refused unless CONFIG or --set name it too or --trust-run-code is given."""
    from fastgrpo.config import config_from_dict, parse_override, read_yaml, set_dotted, validate
    from fastgrpo.train.resume import check_run_code

    path = checkpoint / "config.yaml"
    if not path.is_file():
        path = checkpoint.parent.parent / "config.yaml"
    data = read_yaml(path) if path.is_file() else {}
    preset = read_yaml(args.config) if args.config else {}
    yours = config_from_dict(preset)  # what this command itself names
    for item in args.overrides:
        set_dotted(yours, *parse_override(item))
    layered = {**data}
    for section, value in preset.items():
        if isinstance(value, dict) and isinstance(layered.get(section), dict):
            layered[section] = {**layered[section], **value}
        else:
            layered[section] = value
    config = config_from_dict(layered)
    for item in args.overrides:
        set_dotted(config, *parse_override(item))
    validate(config)
    check_run_code(config, yours, path.parent, trust=args.trust_run_code)
    return config


if __name__ == "__main__":
    sys.exit(main())
