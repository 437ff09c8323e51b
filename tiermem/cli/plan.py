"""`tiermem plan CONFIG.yaml --hf-config config.json`: what a model would hold in each tier, whether it fits, and
how fast a step could go, before anything runs (see [Note: plans] in tiermem/planning.py)."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from tiermem.cli.config_cmd import _parse_set
from tiermem.errors import ConfigError
from tiermem.sizes import short_repr

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


# [Note: planning from a config.json]
# `tiermem plan` builds the model a config.json describes on the meta device: no weights, but every module,
# and plans every unit, which take tens of milliseconds a layer together, so the config is checked before
# anything is built. The sizes that decide the shapes (SIZE_KEYS, at any depth: text_config.num_hidden_layers
# too) must be integers within bounds: layer and expert counts at most MAX_MODULE_COUNT, which plans in well
# under a minute (ten million layers took hours; the deepest released models have about 130), widths at most
# MAX_WIDTH and positions at most MAX_POSITIONS, so that no tensor's element count passes int64.
# `architectures` may only name model classes of transformers (subclasses of PreTrainedModel): the names are
# looked up on the transformers package, and whatever else they name (AutoConfig, a submodule) is never
# called. What transformers itself then refuses is one line naming the file.
MAX_CONFIG_JSON_BYTES = 16 << 20
MAX_MODULE_COUNT = 512
MAX_WIDTH = 1 << 24
MAX_POSITIONS = (1 << 31) - 1
_LAYER_KEYS = frozenset({"num_hidden_layers", "n_layer", "n_layers", "num_layers", "encoder_layers", "decoder_layers",
                         "num_encoder_layers", "num_decoder_layers"})
_EXPERT_KEYS = frozenset({"num_local_experts", "num_experts", "n_routed_experts", "n_shared_experts",
                          "moe_num_experts"})  # 0 (a dense model) allowed
_WIDTH_KEYS = frozenset({"hidden_size", "n_embd", "d_model", "intermediate_size", "n_inner", "ffn_dim", "d_ff",
                         "encoder_ffn_dim", "decoder_ffn_dim", "moe_intermediate_size", "vocab_size",
                         "num_attention_heads", "n_head", "n_heads", "num_key_value_heads", "encoder_attention_heads",
                         "decoder_attention_heads", "head_dim", "d_kv"})
_POSITION_KEYS = frozenset({"max_position_embeddings", "n_positions", "n_ctx"})
SIZE_KEYS = _LAYER_KEYS | _EXPERT_KEYS | _WIDTH_KEYS | _POSITION_KEYS


def _check_sizes(raw: dict[str, Any], where: str) -> None:
    """Refuse a size in `raw` (and the configs nested in it) outside [Note: planning from a config.json]'s
    bounds, naming its key path."""
    stack: list[tuple[str, Any]] = [("", raw)]
    while stack:
        prefix, obj = stack.pop()
        for key, value in obj.items():
            if isinstance(value, dict):
                stack.append((f"{prefix}{key}.", value))
                continue
            if key not in SIZE_KEYS or value is None:  # None: the config's default (n_inner, head_dim, ...)
                continue
            low = 0 if key in _EXPERT_KEYS else 1
            high = (MAX_MODULE_COUNT if key in _LAYER_KEYS | _EXPERT_KEYS else
                    MAX_POSITIONS if key in _POSITION_KEYS else MAX_WIDTH)
            values = value if isinstance(value, list) and value else [value]  # some configs give one per layer
            if all(isinstance(v, int) and not isinstance(v, bool) and low <= v <= high for v in values):
                continue
            why = (" (the planner builds every layer on the meta device; released models have at most about 130)"
                   if key in _LAYER_KEYS else " (each expert is built on the meta device)" if key in _EXPERT_KEYS
                   else "")
            raise ConfigError(f"{where}: {prefix}{key}: expected an integer from {low} to {high}{why}, got "
                              f"{short_repr(value)}; fix the config")


def _model_class(transformers: Any, raw: dict[str, Any], where: str) -> Any:
    """The model class `architectures` names, or None where it names none this transformers has (a model with
    remote code: model_type's causal-LM class is built instead). Only a subclass of PreTrainedModel is taken."""
    names = raw.get("architectures")
    if names is None:
        return None
    hint = ("name the model class (a subclass of transformers.PreTrainedModel, such as GPT2LMHeadModel), or remove "
            "architectures to build model_type's causal-LM class")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ConfigError(f"{where}: architectures: expected a list of model class names, got {short_repr(names)}; "
                          + hint)
    for name in names:
        try:
            found = getattr(transformers, name, None) if name.isidentifier() and not name.startswith("_") else None
        except (ImportError, RuntimeError):  # a lazily imported class whose optional dependency is missing
            found = None
        if found is None:
            continue
        if not isinstance(found, type) or not issubclass(found, transformers.PreTrainedModel):
            raise ConfigError(f"{where}: architectures: {name!r} is not a model class of transformers; {hint}")
        return found
    return None


def _first_line(exc: BaseException) -> str:
    """`exc` as one line: its type and the first non-empty lines of its message, joined (torch and
    huggingface_hub errors span several, with a C++ backtrace)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {' '.join(lines[:2])}"[:300]


def build_model(path: str) -> Any:
    """The transformers model `path` (a config.json) describes, on the meta device, after the checks of
    [Note: planning from a config.json]."""
    where = f"--hf-config {path}"
    if not os.path.isfile(path):
        what = ("is a directory; pass its config.json" if os.path.isdir(path) else
                "is not a regular file; pass a model's config.json" if os.path.exists(path) else "does not exist")
        raise ConfigError(f"{where}: {what}")
    if os.path.getsize(path) > MAX_CONFIG_JSON_BYTES:
        raise ConfigError(f"{where}: larger than {MAX_CONFIG_JSON_BYTES >> 20} MiB, which no model config is; pass "
                          "a model's config.json")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except RecursionError:
        raise ConfigError(f"{where}: JSON nested deeper than Python's reader follows; pass a model's "
                          "config.json") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{where}: cannot read it as JSON ({exc})") from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise ConfigError(f"{where}: not a transformers config (no model_type); pass a model's config.json")
    _check_sizes(raw, where)
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise ConfigError(f"--hf-config needs transformers ({exc}); pip install transformers") from None
    cls = _model_class(transformers, raw, where)
    # transformers runs the config's own code on the user's values: what it raises (strict dataclass
    # validation, a ZeroDivisionError from a width of 0, torch's shape errors) is one line naming the file
    try:
        hf = transformers.AutoConfig.for_model(**raw)
    except Exception as exc:
        raise ConfigError(f"{where}: transformers cannot build a config from it ({_first_line(exc)})") from None
    with torch.device("meta"):
        try:
            return cls(hf) if cls is not None else transformers.AutoModelForCausalLM.from_config(hf)
        except ValueError as exc:
            if cls is None and "Unrecognized configuration class" in str(exc):
                raise ConfigError(f"{where}: no causal-LM class for model_type {short_repr(raw['model_type'])}; "
                                  "add an 'architectures' entry naming the model class") from None
            raise ConfigError(f"{where}: transformers cannot build the model from it ({_first_line(exc)})") from None
        except Exception as exc:
            raise ConfigError(f"{where}: transformers cannot build the model from it ({_first_line(exc)})") from None


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
