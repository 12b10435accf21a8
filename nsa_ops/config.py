"""NSAConfig: the hyper-parameters of one NSA attention layer, with YAML load/save."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import yaml

from .reference import num_cmp

PHIS = ("mean", "mlp")
GATE_ACTS = ("sigmoid", "softmax")
BRANCHES = ("cmp", "sel", "win")


def _fail(field: str, msg: str):
    raise ValueError(f"NSAConfig.{field} {msg}")


@dataclass
class NSAConfig:
    """One NSA layer: q/k/v/o projections over ``hidden_size``, HQ query heads sharing H KV heads.

    Geometry defaults are the paper's (l=32, d=16, l'=64, n=16, w=512); see NSA-SPEC.md.
    ``max_position`` (optional) bounds the RoPE positions a module accepts.
    """
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim_qk: int
    head_dim_v: int
    block_len: int = 32
    block_stride: int = 16
    sel_block: int = 64
    num_sel: int = 16
    window: int = 512
    phi: str = "mean"
    gate_act: str = "sigmoid"
    rope_theta: float = 10000.0
    max_position: Optional[int] = None
    bias: bool = False
    # diagnostic for ablations: only this branch's gate stays, the other two are zero
    force_branch: Optional[str] = None

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first offending field."""
        for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim_qk", "head_dim_v",
                     "block_len", "block_stride", "sel_block", "num_sel", "window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                _fail(name, f"must be a positive int, got {value!r}")
        if self.max_position is not None and (isinstance(self.max_position, bool)
                                              or not isinstance(self.max_position, int)
                                              or self.max_position <= 0):
            _fail("max_position", f"must be a positive int or null, got {self.max_position!r}")
        if self.num_heads % self.num_kv_heads:
            _fail("num_heads", f"must be a multiple of num_kv_heads (GQA), got "
                               f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}")
        if self.head_dim_qk % 2:
            _fail("head_dim_qk", f"must be even (RoPE rotates pairs), got {self.head_dim_qk}")
        if self.block_len % self.block_stride:
            _fail("block_stride", f"must divide block_len (d | l), got block_len={self.block_len}"
                                  f", block_stride={self.block_stride}")
        if self.sel_block % self.block_stride:
            _fail("block_stride", f"must divide sel_block (d | l'), got sel_block="
                                  f"{self.sel_block}, block_stride={self.block_stride}")
        if self.num_sel < 3:
            _fail("num_sel", f"must be >= 3 (block 0 and the two local blocks are always "
                             f"selected), got {self.num_sel}")
        if self.phi not in PHIS:
            _fail("phi", f"must be one of {PHIS}, got {self.phi!r}")
        if self.gate_act not in GATE_ACTS:
            _fail("gate_act", f"must be one of {GATE_ACTS}, got {self.gate_act!r}")
        if isinstance(self.rope_theta, bool) or not isinstance(self.rope_theta, (int, float)) \
                or not 0 < self.rope_theta < float("inf"):
            _fail("rope_theta", f"must be a finite positive number, got {self.rope_theta!r}")
        if not isinstance(self.bias, bool):
            _fail("bias", f"must be true or false, got {self.bias!r}")
        if self.force_branch is not None and self.force_branch not in BRANCHES:
            _fail("force_branch", f"must be one of {BRANCHES} or null, got "
                                  f"{self.force_branch!r}")

    # ---- derived numbers ---------------------------------------------------------------------

    @property
    def group(self) -> int:
        """G = HQ / H query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def scale(self) -> float:
        return self.head_dim_qk ** -0.5

    def num_cmp(self, seq_len: int) -> int:
        return num_cmp(seq_len, self.block_len, self.block_stride)

    def reads(self, seq_len: int) -> int:
        """Cache rows one query at position seq_len - 1 reads: num_cmp(S) + n*l' + min(w, S)."""
        return self.num_cmp(seq_len) + self.num_sel * self.sel_block + min(self.window, seq_len)

    # ---- YAML ----------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data) -> "NSAConfig":
        if not isinstance(data, dict):
            raise ValueError(f"an NSA config must be a mapping of field: value, "
                             f"got {type(data).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ValueError(f"unknown NSAConfig keys: {', '.join(map(str, unknown))} "
                             f"(known: {', '.join(fields)})")
        missing = [name for name, f in fields.items() if f.default is dataclasses.MISSING
                   and name not in data]
        if missing:
            raise ValueError(f"missing NSAConfig keys: {', '.join(missing)}")
        return cls(**data)

    @classmethod
    def from_yaml(cls, path) -> "NSAConfig":
        with open(path) as f:
            return cls.from_dict(yaml.safe_load(f))

    def to_yaml(self, path=None) -> str:
        """The config as YAML text; also written to ``path`` when given."""
        text = yaml.safe_dump(dataclasses.asdict(self), sort_keys=False)
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text
