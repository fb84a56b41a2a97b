"""`tritonllm spec ...`: speculative-decoding tools (argparse only here; the work is imported on use)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

_DTYPES = ("float32", "bfloat16", "float16")


def add_spec_command(sub) -> None:
    spec = sub.add_parser("spec", help="speculative decoding tools")
    kinds = spec.add_subparsers(dest="spec_command", required=True)
    train = kinds.add_parser(
        "train-medusa",
        help="train Medusa heads for a model (base frozen; minutes on CPU "
        "for SmolLM2) and save them in the Medusa checkpoint format",
    )
    train.add_argument("--model", required=True, help="Hugging Face model folder")
    train.add_argument("--out", required=True, help="folder for config.json + medusa_lm_head.safetensors")
    train.add_argument("--heads", type=int, default=3, help="number of Medusa heads")
    train.add_argument("--layers", type=int, default=1, help="ResBlocks per head")
    train.add_argument("--steps", type=int, default=200, help="optimizer steps")
    train.add_argument("--batch", type=int, default=256, help="positions per step")
    train.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (cosine decay over --steps)")
    train.add_argument("--text", help="UTF-8 training text (default: the English text shipped with tritonllm)")
    train.add_argument(
        "--distill-tokens",
        type=int,
        default=0,
        help="also train on about this many tokens of the model's own greedy continuations",
    )
    _distill_arguments(
        train,
        0,
        " instead of on the text; accuracy is then measured on its answers to the "
        "`bench spec` requests, never trained on",
    )
    train.add_argument("--device", default="cpu", help="where to train: cpu, cuda, cuda:1 ...")
    train.add_argument(
        "--share-lm-head",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="heads use the model's own LM head (frozen; only the ResBlocks train; a few MB, our "
        "medusa_shared_lm_head format extension); --no-share-lm-head gives each head its own "
        "trained copy, in the standard Medusa format (vocab x hidden per head)",
    )
    train.add_argument(
        "--draft-vocab",
        type=int,
        default=0,
        help="save the N tokens the model chooses most often as the heads' draft vocabulary "
        "(guessing among them alone makes the heads cheaper; our format extension); 0: all",
    )
    train.add_argument(
        "--held-out",
        type=float,
        default=0.1,
        help="fraction of the text (its end) kept out of training; accuracy is measured on it",
    )
    _output_arguments(train, "heads")
    _add_train_eagle(kinds)


def _distill_arguments(parser, prompts_default: int, prompts_help: str) -> None:
    """Self-distillation flags shared by train-medusa and train-eagle."""
    parser.add_argument(
        "--distill-prompts",
        type=int,
        default=prompts_default,
        help="train on the model's own greedy answers to about this many chat requests (rewrite, "
        "summarise, explain ... the shipped texts and topics)" + prompts_help,
    )
    parser.add_argument("--distill-max-tokens", type=int, default=256, help="longest self-distilled answer")
    parser.add_argument("--distill-batch", type=int, default=16, help="requests per generate call")
    parser.add_argument(
        "--distill-rounds",
        type=int,
        default=1,
        help="answers per request: the first greedy, the others sampled at --distill-temperature "
        "(the targets stay the model's greedy choices)",
    )
    parser.add_argument(
        "--distill-temperature",
        type=float,
        default=0.7,
        help="sampling temperature of the extra --distill-rounds answers",
    )
    parser.add_argument(
        "--distill-own-requests",
        type=int,
        default=0,
        help="with --distill-prompts: also answer this many requests the model writes itself "
        "(sampled user messages: far more subjects than the shipped topics; those naming a "
        "chat bench topic are dropped), for training only",
    )
    parser.add_argument(
        "--validation-share",
        type=float,
        default=0.05,
        help="with --distill-prompts: share of the topics kept out of training; the weights kept "
        "are the checkpoint (every --eval-every steps) that does best on them",
    )
    parser.add_argument("--eval-every", type=int, default=100, help="steps between validation checks")


def _output_arguments(parser, what: str) -> None:
    parser.add_argument(
        "--time-limit",
        type=float,
        default=0.0,
        help="stop the optimizer steps this many seconds after the command started (distillation "
        "included) and save the best weights so far; 0: no limit",
    )
    parser.add_argument("--save-dtype", choices=_DTYPES, default="float32", help="dtype of the saved weights")
    parser.add_argument("--seed", type=int, default=0, help=f"seeds the initial {what}, batches and distillation")
    parser.add_argument(
        "--json", action="store_true", help="print the training report as one JSON line (progress bars stay on stderr)"
    )


def _add_train_eagle(kinds) -> None:
    train = kinds.add_parser(
        "train-eagle",
        help="train an EAGLE-1/2 draft layer (or, with --eagle3, an EAGLE-3 "
        "one) for a model on its own answers (base frozen; meant for a "
        "GPU) and save it in the EAGLE (EAGLE-3) format",
    )
    train.add_argument("--model", required=True, help="Hugging Face model folder")
    train.add_argument("--out", required=True, help="folder for config.json + model.safetensors")
    train.add_argument("--steps", type=int, default=200, help="optimizer steps")
    train.add_argument("--batch", type=int, default=8, help="sequences per step")
    train.add_argument("--lr", type=float, default=5e-4, help="AdamW learning rate (warm-up, then cosine decay)")
    train.add_argument(
        "--passes",
        type=int,
        default=3,
        help="training-time test depth: pass k feeds each position the draft's own pass k-1 "
        "output, as drafting k deep does",
    )
    train.add_argument(
        "--token-weight",
        type=float,
        default=0.1,
        help="weight of the LM-head cross-entropy beside the feature regression (not with --eagle3)",
    )
    train.add_argument(
        "--feature-noise",
        type=float,
        default=0.05,
        help="uniform noise on the input features, in units of their standard deviation",
    )
    train.add_argument(
        "--draft-vocab",
        type=int,
        default=0,
        help="save the N tokens the model chooses most often as the draft vocabulary (drafting "
        "from them alone makes each draft step cheaper; our format extension, EAGLE-3's own "
        "d2t with --eagle3); 0: all",
    )
    _eagle3_arguments(train)
    train.add_argument("--text", help="UTF-8 text whose paragraphs the requests are about (default: the shipped one)")
    _distill_arguments(
        train, 64, "; accuracy is measured on its answers to the `bench spec` requests, never trained on"
    )
    train.add_argument("--device", default="cpu", help="where to train: cpu, cuda, cuda:1 ...")
    _output_arguments(train, "draft")


def _eagle3_arguments(parser) -> None:
    parser.add_argument(
        "--eagle3",
        action="store_true",
        help="train an EAGLE-3 draft instead (run it with speculative_config decoding_type Eagle3): "
        "it reads the outputs of the --capture-layers target layers side by side, squeezed by "
        "its fc, has its own head over the --draft-vocab tokens (all by default; started from "
        "the model's LM-head rows and final norm) and learns from that head's cross-entropy "
        "against the model's greedy choices alone (no feature regression, no --token-weight); "
        "the --passes, validation and output flags work as for EAGLE-1/2",
    )
    parser.add_argument(
        "--capture-layers",
        type=int,
        nargs="+",
        metavar="LAYER",
        help="with --eagle3: the target layers (0-based) whose outputs the draft reads, at least two "
        "distinct ones, each below the last layer (transformers shows the last layer's output "
        "only after the final norm); saved as eagle_aux_hidden_state_layer_ids (each + 1); "
        "default: EAGLE-3's 1, L/2-1 and L-4 for a model of L layers (e.g. 1 14 26 for 30)",
    )


def add_bench_command(kinds, engine_arguments) -> None:
    """`tritonllm bench spec` (registered by commands/main.py next to the other benchmarks)."""
    from tritonllm.commands.bench_spec import add_arguments

    bench = kinds.add_parser(
        "spec",
        help="batch-1 decode tok/s with speculative decoding vs without, same engine, one run (input-grounded prompts)",
    )
    engine_arguments(bench)
    add_arguments(bench)


def run_spec_command(args) -> int:
    if args.spec_command == "train-eagle":
        return _run_train_eagle(args)
    return _run_train_medusa(args)


def _check_common(args, positive: tuple[str, ...]) -> None:
    from tritonllm.engine.config import ConfigError

    for name in positive + ("steps", "batch", "distill_max_tokens", "distill_batch", "distill_rounds", "eval_every"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.validation_share < 1 or args.distill_temperature <= 0:
        raise ConfigError("--validation-share must be in [0, 1) and --distill-temperature > 0")
    if args.time_limit < 0:
        raise ConfigError(f"--time-limit must be >= 0 seconds, got {args.time_limit}")
    if args.distill_own_requests < 0:
        raise ConfigError(f"--distill-own-requests must be >= 0, got {args.distill_own_requests}")


def _run_train_medusa(args) -> int:
    import torch

    from tritonllm.engine.config import ConfigError
    from tritonllm.spec_decode.training.train_medusa import TrainSettings, train_medusa

    _check_common(args, ("heads", "layers"))
    if args.distill_prompts < 0 or args.distill_tokens < 0 or args.draft_vocab < 0:
        raise ConfigError("--distill-prompts, --distill-tokens and --draft-vocab must be >= 0")
    if not 0 <= args.held_out < 1:
        raise ConfigError(f"--held-out must be in [0, 1), got {args.held_out}")
    text = Path(args.text).read_text(encoding="utf-8") if args.text else None
    settings = TrainSettings(
        num_heads=args.heads,
        num_layers=args.layers,
        steps=args.steps,
        batch_positions=args.batch,
        learning_rate=args.lr,
        distill_tokens=args.distill_tokens,
        seed=args.seed,
        save_dtype=getattr(torch, args.save_dtype),
        progress=True,
        share_lm_head=args.share_lm_head,
        held_out=args.held_out,
        distill_prompts=args.distill_prompts,
        distill_max_tokens=args.distill_max_tokens,
        distill_batch=args.distill_batch,
        device=args.device,
        distill_rounds=args.distill_rounds,
        distill_temperature=args.distill_temperature,
        distill_own_requests=args.distill_own_requests,
        validation_share=args.validation_share,
        eval_every=args.eval_every,
        draft_vocab=args.draft_vocab,
        time_limit=args.time_limit,
    )
    report = train_medusa(args.model, args.out, settings, text)
    summary = {
        "out": str(report.out_dir),
        "tokens": report.num_tokens,
        "first_loss": round(report.first_loss, 4),
        "last_loss": round(report.last_loss, 4),
        "head_accuracy": [round(a, 4) for a in report.head_accuracy],
        "train_accuracy": [round(a, 4) for a in report.train_accuracy],
        "held_out_tokens": report.held_out_tokens,
        "shared_lm_head": args.share_lm_head,
        "best_step": report.best_step,
        "validation_accuracy": [round(a, 4) for a in report.validation_accuracy or []],
        "seconds": round(report.seconds, 1),
    }
    if args.json:
        print(json.dumps(summary))
    else:
        accuracy = ", ".join(f"head {h}: {a:.1%}" for h, a in enumerate(report.head_accuracy))
        where = f"on {report.held_out_tokens} held-out tokens" if report.held_out_tokens else "on the training data"
        print(
            f"Medusa heads saved to {report.out_dir} ({report.num_tokens} training tokens, loss "
            f"{report.first_loss:.3f} -> {report.last_loss:.3f}, top-1 agreement with the model {where}: "
            f"{accuracy}, {report.seconds:.0f} s)"
        )
    return 0


def _run_train_eagle(args) -> int:
    import torch

    from tritonllm.engine.config import ConfigError
    from tritonllm.spec_decode.training.train_eagle import EagleTrainSettings, train_eagle
    from tritonllm.spec_decode.training.train_eagle3 import Eagle3TrainSettings, train_eagle3

    _check_common(args, ("passes", "distill_prompts"))
    if args.draft_vocab < 0 or args.token_weight < 0 or args.feature_noise < 0:
        raise ConfigError("--draft-vocab, --token-weight and --feature-noise must be >= 0")
    if args.capture_layers is not None and not args.eagle3:
        raise ConfigError("--capture-layers is for EAGLE-3 drafts: add --eagle3")
    text = Path(args.text).read_text(encoding="utf-8") if args.text else None
    layers = tuple(args.capture_layers) if args.capture_layers else None
    common: dict[str, Any] = dict(
        steps=args.steps,
        batch_sequences=args.batch,
        learning_rate=args.lr,
        passes=args.passes,
        token_weight=args.token_weight,
        feature_noise=args.feature_noise,
        draft_vocab=args.draft_vocab,
        distill_prompts=args.distill_prompts,
        distill_max_tokens=args.distill_max_tokens,
        distill_batch=args.distill_batch,
        distill_rounds=args.distill_rounds,
        distill_temperature=args.distill_temperature,
        distill_own_requests=args.distill_own_requests,
        validation_share=args.validation_share,
        eval_every=args.eval_every,
        seed=args.seed,
        device=args.device,
        save_dtype=getattr(torch, args.save_dtype),
        time_limit=args.time_limit,
    )
    if args.eagle3:
        report = train_eagle3(args.model, args.out, Eagle3TrainSettings(**common, capture_layers=layers), text)
    else:
        report = train_eagle(args.model, args.out, EagleTrainSettings(**common), text)
    summary = {
        "out": str(report.out_dir),
        "tokens": report.num_tokens,
        "first_loss": round(report.first_loss, 4),
        "last_loss": round(report.last_loss, 4),
        "depth_accuracy": [round(a, 4) for a in report.accuracy],
        "validation_accuracy": [round(a, 4) for a in report.validation_accuracy or []],
        "best_step": report.best_step,
        "draft_vocab": report.draft_vocab,
        "seconds": round(report.seconds, 1),
    }
    if args.eagle3:
        summary.update(eagle3=True, capture_layers=report.capture_layers)
    if args.json:
        print(json.dumps(summary))
    else:
        accuracy = ", ".join(f"depth {k}: {a:.1%}" for k, a in enumerate(report.accuracy, 1))
        captured = f", capture layers {report.capture_layers}" if args.eagle3 else ""
        print(
            f"{'EAGLE-3' if args.eagle3 else 'EAGLE'} draft saved to {report.out_dir} ({report.num_tokens} "
            f"training tokens{captured}, loss {report.first_loss:.3f} -> {report.last_loss:.3f}, top-1 agreement "
            f"with the model on the bench's requests: {accuracy}, {report.seconds:.0f} s)"
        )
    return 0
