"""`tiermem plan CONFIG.yaml --hf-config config.json`: what a model would hold in each tier, whether it fits, and
how fast a step could go, before anything runs (see [Note: plans] in tiermem/planning.py)."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from tiermem.cli.config_cmd import _parse_set
from tiermem.errors import ConfigError

# tiermem.planning.OPTIMIZER_NAMES, without importing torch to parse arguments (a test keeps the two equal)
OPTIMIZER_CHOICES = ("adamw", "adam", "sgd", "rmsprop", "adagrad", "adadelta", "adamax", "nadam", "radam", "rprop",
                     "asgd")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="bytes per tier, whether it fits, and a step-time bound, before running",
                       description="Plan tiered_offload for a transformers model built from its config on the meta "
                       "device (no weights are read or allocated).")
    p.add_argument("config", help="the swap-config YAML")
    p.add_argument("--hf-config", required=True, metavar="config.json",
                   help="a transformers model config (config.json of a model directory)")
    p.add_argument("--batch", default=None, metavar="BxT", help="batch size x sequence length of input_ids, e.g. "
                   "2x128, to estimate the activations a training step saves")
    p.add_argument("--generate", default=None, metavar="BxP+N", help="plan generate() of N new tokens for B prompts "
                   "of P tokens, e.g. 32x128+32: the KV cache's bytes per tier and each decoding step's bounds")
    p.add_argument("--optimizer", choices=OPTIMIZER_CHOICES, default=None,
                   help="plan training with this optimizer (default: inference)")
    p.add_argument("--set", action="append", type=_parse_set, metavar="KEY=VALUE",
                   help="override one config key, e.g. --set memory.host_budget=8GiB (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def parse_batch(text: str | None) -> tuple[int, int] | None:
    """`--batch 2x128` as (2, 128); ConfigError naming the flag for anything else."""
    if text is None:
        return None
    parts = text.lower().split("x")
    try:
        dims = tuple(int(x) for x in parts)
    except ValueError:
        dims = ()
    if len(dims) != 2 or min(dims) < 1:
        raise ConfigError(f"--batch: expected BATCHxLENGTH such as 2x128, got {text!r}")
    return dims[0], dims[1]


def parse_generate(text: str | None) -> tuple[int, int, int] | None:
    """`--generate 32x128+32` as (32, 128, 32); ConfigError naming the flag for anything else."""
    if text is None:
        return None
    batch, _, rest = text.lower().partition("x")
    prompt, _, new = rest.partition("+")
    try:
        dims = (int(batch), int(prompt), int(new))
    except ValueError:
        dims = (0, 0, 0)
    if min(dims) < 1:
        raise ConfigError(f"--generate: expected BATCHxPROMPT+NEW such as 32x128+32, got {text!r}")
    return dims


def build_model(path: str) -> Any:
    """The transformers model `path` (a config.json) describes, on the meta device."""
    if not os.path.isfile(path):
        what = "is a directory; pass its config.json" if os.path.isdir(path) else "does not exist"
        raise ConfigError(f"--hf-config {path}: {what}")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--hf-config {path}: cannot read it as JSON ({exc})") from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise ConfigError(f"--hf-config {path}: not a transformers config (no model_type); pass a model's "
                          "config.json")
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise ConfigError(f"--hf-config needs transformers ({exc}); pip install transformers") from None
    try:
        hf = transformers.AutoConfig.for_model(**raw)
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"--hf-config {path}: transformers cannot build a config from it ({exc})") from None
    named = [getattr(transformers, a, None) for a in raw.get("architectures") or []]
    with torch.device("meta"):
        for cls in named:
            if cls is not None:
                return cls(hf)  # the architecture the config names
        try:
            return transformers.AutoModelForCausalLM.from_config(hf)
        except ValueError as exc:
            raise ConfigError(f"--hf-config {path}: no causal-LM class for model_type {raw['model_type']!r} ({exc}); "
                              "add an 'architectures' entry naming the model class") from None


def run(args: argparse.Namespace) -> int:
    from tiermem.planning import plan

    if not os.path.isfile(args.config):
        raise ConfigError(f"{args.config}: config file does not exist; check the path")
    batch = parse_batch(args.batch)
    generate = parse_generate(args.generate)
    if generate is not None and args.optimizer is not None:
        raise ConfigError("--generate plans inference; drop --optimizer")
    model = build_model(args.hf_config)
    result = plan(model, args.config, optimizer=args.optimizer, batch=batch, generate=generate,
                  **dict(args.set or []))
    print(result.to_json() if args.json else result.summary())
    return 0
