"""Ranks on another machine for a multi-node run (tested only within one machine, see README "Several GPUs"):

    python -m h3_core.parallel --model /models/MiniMax-H3 --devices cuda:0,cuda:1,cuda:2,cuda:3 \
        --init-method tcp://NODE0:29500 --world-size 8 --first-rank 4

(the first machine's runner: ParallelRunner(spec, its 4 devices, init_method="tcp://NODE0:29500",
world_size=8); the world size must divide the 56 heads.)
"""

from __future__ import annotations

import argparse

from ..cli import add_dit_speed_options, lora_option
from ..local_attention import check_setting as check_window_setting
from ..pipeline import MODEL_DTYPES
from .workers import ModelSpec, serve_ranks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m h3_core.parallel", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the same checkpoint path the caller's node loads")
    parser.add_argument("--partition", default="fl2va", choices=["fl2va", "ref2va"],
                        help="the caller's DiT partition (default fl2va)")
    parser.add_argument("--dtype", default="bf16", choices=list(MODEL_DTYPES),
                        help="the caller's weight dtype (default bf16)")
    add_dit_speed_options(parser)  # the same as the caller's
    parser.add_argument("--lora", action="append", default=[], metavar="PATH[:STRENGTH]",
                        help="the same adapters, in the same order, as the caller")
    parser.add_argument("--lora-unknown-keys", default="error", choices=["error", "warn"],
                        help="as the caller: warn loads an adapter's keys that name an H3 module and reports the rest")
    parser.add_argument("--devices", required=True, help="comma-separated, e.g. cuda:0,cuda:1")
    parser.add_argument("--init-method", required=True, help="the caller's rendezvous, e.g. tcp://NODE0:29500")
    parser.add_argument("--world-size", type=int, required=True, help="ranks on all machines together")
    parser.add_argument("--first-rank", type=int, required=True, help="rank of this machine's first device")
    parser.add_argument("--shard-weights", action="store_true", help="as the caller: FSDP-style block sharding")
    args = parser.parse_args(argv)
    devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    try:
        loras = tuple((str(path), strength) for path, strength in map(lora_option, args.lora))
        window, dense_steps = check_window_setting(args.attention_window_lossy, args.attention_window_dense_steps)
        spec = ModelSpec(args.model, args.partition, MODEL_DTYPES[args.dtype], args.attention, loras, args.linears,
                         compile=args.compile, attention_window=window, attention_window_dense_steps=dense_steps,
                         lora_unknown_keys=args.lora_unknown_keys)
        return serve_ranks(spec, devices, args.init_method, args.world_size, args.first_rank, args.shard_weights)
    except ValueError as error:
        parser.error(str(error))


if __name__ == "__main__":
    raise SystemExit(main())
