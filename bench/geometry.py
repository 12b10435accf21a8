"""The attention geometry every bench script takes, and its parsing.

    --heads --kv-heads --dk --dv --block-len --block-stride --sel-block --num-sel --window --batch
    --config FILE.yaml   an NSAConfig in its YAML format (NSAConfig.to_yaml); the flags above
                         override its fields

Without either, the spec geometry the committed results were measured at: HQ=64, H=4,
Dk=Dv=128, l=32, d=16, l'=64, n=16, w=512, hidden 4096 (the layer bench_compiled.py builds), and
each script's own batch default.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional, Sequence, Union

import yaml

from nsa_ops import NSAConfig

SPEC = NSAConfig(hidden_size=4096, num_heads=64, num_kv_heads=4, head_dim_qk=128, head_dim_v=128)
# flag name (without --) -> the NSAConfig field it sets
FLAGS = {"heads": "num_heads", "kv-heads": "num_kv_heads", "dk": "head_dim_qk",
         "dv": "head_dim_v", "block-len": "block_len", "block-stride": "block_stride",
         "sel-block": "sel_block", "num-sel": "num_sel", "window": "window"}


def parser(description: Optional[str],
           batch: Union[int, Sequence[int]] = 1) -> argparse.ArgumentParser:
    """A script's parser holding the geometry arguments. batch: the --batch default; a sequence
    makes --batch a list of sizes the script sweeps."""
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("geometry", "default: --config's, else the spec geometry "
                                         "(bench/geometry.py)")
    g.add_argument("--config", metavar="FILE.yaml", help="an NSAConfig YAML file")
    for flag, field in FLAGS.items():
        g.add_argument(f"--{flag}", type=int, dest=field, metavar="N",
                       help=f"NSAConfig.{field} (spec: {getattr(SPEC, field)})")
    if isinstance(batch, int):
        g.add_argument("--batch", type=int, default=batch, metavar="B",
                       help=f"batch size (default {batch})")
    else:
        g.add_argument("--batch", type=int, nargs="+", default=list(batch), metavar="B",
                       help=f"batch sizes, each timed (default {' '.join(map(str, batch))})")
    return p


def parse(p: argparse.ArgumentParser,
          argv: Optional[Sequence[str]] = None) -> tuple[argparse.Namespace, NSAConfig]:
    """(args, the geometry as an NSAConfig); a config that cannot load or validate is a usage
    error naming the field."""
    args = p.parse_args(argv)
    if min([args.batch] if isinstance(args.batch, int) else args.batch) <= 0:
        p.error(f"--batch must be positive, got {args.batch}")
    overrides = {field: getattr(args, field) for field in FLAGS.values()
                 if getattr(args, field) is not None}
    try:
        base = SPEC if args.config is None else NSAConfig.from_yaml(args.config)
        return args, dataclasses.replace(base, **overrides)
    except (OSError, ValueError, yaml.YAMLError) as e:
        p.error(str(e))


def describe(cfg: NSAConfig, batch: Union[int, Sequence[int]]) -> str:
    """The geometry as a results header names it."""
    return (f"HQ={cfg.num_heads} H={cfg.num_kv_heads} Dk={cfg.head_dim_qk} Dv={cfg.head_dim_v} "
            f"l={cfg.block_len} d={cfg.block_stride} l'={cfg.sel_block} n={cfg.num_sel} "
            f"w={cfg.window} B={batch if isinstance(batch, int) else ','.join(map(str, batch))}")
