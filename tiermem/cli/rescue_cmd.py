"""`tiermem rescue`: the ranks' shares of the weights, written when a with-block raised under several ranks,
put together into one checkpoint (see [Note: rescue at several ranks] in tiermem/rescue.py)."""

from __future__ import annotations

import argparse

from tiermem import rescue


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("rescue", help="put the ranks' rescued shares of the weights together into a checkpoint")
    p.add_argument("dirs", nargs="+", metavar="DIR",
                   help="each rank's tiermem-rescue-rank{R}-of-{N}-... directory, all N of them, in any order")
    p.add_argument("--out", required=True, help="folder to write model.safetensors into")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    path = rescue.join(args.dirs, args.out)
    print(f"wrote {path}: load it with tiered_offload(model, ..., checkpoint={path!r}) or "
          "model.load_state_dict(safetensors.torch.load_file(...))")
    return 0
