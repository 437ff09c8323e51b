"""`tiermem rescue`: the ranks' shares of the weights and optimizer state, written when a with-block raised
under several ranks, put together into one checkpoint (see [Note: rescue at several ranks] in
tiermem/rescue.py)."""

from __future__ import annotations

import argparse

from tiermem import rescue
from tiermem.sizes import format_size


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("rescue", help="put the ranks' rescued shares of the weights and optimizer state together "
                                           "into a checkpoint")
    p.add_argument("dirs", nargs="+", metavar="DIR",
                   help="each rank's tiermem-rescue-rank{R}-of-{N}-... directory, all N of them, in any order")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--out", help="the checkpoint directory to write (replaced if it holds one)")
    what.add_argument("--remove", action="store_true",
                      help="delete these rescue directories instead (each must be one: its name and its files)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.remove:
        for folder in args.dirs:
            size = rescue.remove(folder)
            print(f"removed {folder} ({format_size(size)})")
        return 0
    path = rescue.join(args.dirs, args.out)
    print(f"wrote the checkpoint {path}: resume with tm.load_checkpoint({path!r}) inside tiered_offload (any number "
          "of ranks), or load the weights with from_pretrained when the model is a transformers one")
    return 0
