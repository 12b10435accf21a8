"""Training showcase: a small NSA language model vs a dense-attention baseline.

    python -m nsa_ops.train [--preset cpu|gpu|text_cpu|text_gpu|text_gpu_8k] [--steps N]
                            [--device DEV] [--out DIR] [--seed S] [--force-branch cmp|sel|win]
    torchrun --nproc_per_node N -m nsa_ops.train [--context-parallel] [...]

Task: multi-query associative recall. A long context of blank tokens holds num_facts "fact"
tokens, each binding a key to one of num_values values; the sequence ends with num_queries
queries, each a key followed by its fact. Every fact lies farther back than the sliding
window of every query, so NSA can only recall it through the compressed and selected branches.
Training minimises the cross-entropy of the answers (the fact after each query key): every
other token is a blank or a random draw, so only the answers measure recall.

Task "text" (the text_* presets): byte-level language modelling of the Python standard library's
sources (every CPython ships them, so nothing is downloaded); every tenth module, by name, is the
held-out eval split. The loss is the mean cross-entropy of every next byte, "answer acc" the
next-byte accuracy.

NSA and dense attention share everything else: data order, the initial weights of all layers
they have in common, AdamW with linear warmup and cosine decay, steps. Writes train_loss.csv and
train_loss.png (needs matplotlib) into --out; elapsed_s counts training time, not evaluation.

Under torchrun the ranks train one model together, sharded with FSDP2 (fully_shard on each block
and the model), on cuda:LOCAL_RANK over NCCL, or on the CPU over gloo (--device cpu, or no CUDA).
Each step's batch is the single-process run's: the ranks split its rows (data parallel), or with
--context-parallel each sequence's tokens (the zigzag split of nsa_ops.distributed, so every
attention layer attends over the whole sequence). Rank 0 prints and writes the results; the
losses it logs are over the whole batch.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import platform
import sys
import sysconfig
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from . import distributed as cp
from . import reference
from .config import NSAConfig
from .module import AttentionProjections, NSAAttention
from .results import commit, new_figure, save_figure, write_csv

MODELS = ("nsa", "dense")
TASKS = ("recall", "text")
WARMUPS = ("short_len", "short_steps", "gate_hold")  # Preset fields where 0 means none
CSV_FIELDS = ("step", "model", "train_loss", "eval_loss", "eval_answer_acc", "elapsed_s",
              "sel_hit", "cmp_mass", "gate_cmp", "gate_sel", "gate_win")
BLANK = 0
# keeps the eval batch out of the training stream whatever the seed
EVAL_SEED_OFFSET = 1_000_003


@dataclass(frozen=True)
class Preset:
    """Model, data, optimisation and NSA geometry of one run."""
    seq_len: int
    batch_size: int
    steps: int
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_keys: int       # key vocabulary; keys are distinct within a sequence
    num_values: int     # values per key: chance accuracy is 1 / num_values
    num_facts: int      # facts hidden in the context
    num_queries: int    # of them, asked at the end
    lr: float
    warmup: int
    eval_every: int
    eval_batch_size: int
    block_len: int
    block_stride: int
    sel_block: int
    num_sel: int
    window: int
    phi: str = "mean"
    weight_decay: float = 0.1
    mlp_ratio: int = 4
    bf16: bool = False  # autocast, honoured on CUDA only
    force_branch: Optional[str] = None  # NSAConfig.force_branch: an ablation of NSA's branches
    gate_act: str = "sigmoid"  # NSAConfig.gate_act
    # learning-rate multipliers of NSA's gate MLP and phi MLPs (1: the model's lr)
    gate_lr_mult: float = 1.0
    phi_lr_mult: float = 1.0
    # warm-ups (0: none): the first short_steps steps train on sequences of short_len tokens (a
    # length curriculum); the gate MLPs do not learn for the first gate_hold steps
    short_len: int = 0
    short_steps: int = 0
    gate_hold: int = 0
    task: str = "recall"  # or "text": the recall fields (keys, values, facts, queries) unused

    @property
    def vocab_size(self) -> int:
        if self.task == "text":
            return 256
        return 1 + self.num_keys * (1 + self.num_values)

    @property
    def chance(self) -> float:
        """The accuracy of guessing: one value of num_values, or one byte of 256."""
        return 1 / (256 if self.task == "text" else self.num_values)

    def short(self) -> "Preset":
        """This preset at the curriculum's length (short_len)."""
        return dataclasses.replace(self, seq_len=self.short_len, short_len=0, short_steps=0)

    def at_step(self, step: int) -> "Preset":
        """The preset whose sequences train step `step` (1-based) draws."""
        return self.short() if step <= self.short_steps else self

    @property
    def context_len(self) -> int:
        """Tokens before the query section (the last 2 * num_queries inputs and targets)."""
        return self.seq_len + 1 - 2 * self.num_queries

    def nsa_config(self) -> NSAConfig:
        return NSAConfig(hidden_size=self.hidden_size, num_heads=self.num_heads,
                         num_kv_heads=self.num_kv_heads, head_dim_qk=self.head_dim,
                         head_dim_v=self.head_dim, block_len=self.block_len,
                         block_stride=self.block_stride, sel_block=self.sel_block,
                         num_sel=self.num_sel, window=self.window, phi=self.phi,
                         force_branch=self.force_branch, gate_act=self.gate_act)

    def validate(self) -> None:
        """Raise ValueError naming the first field that cannot work."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            least, kind = (0, "an int >= 0") if f.name in WARMUPS else (1, "a positive int")
            if f.type == "int" and (isinstance(value, bool) or not isinstance(value, int)
                                    or value < least):
                raise ValueError(f"Preset.{f.name} must be {kind}, got {value!r}")
        if (self.short_len > 0) != (self.short_steps > 0):
            raise ValueError(f"Preset.short_len and short_steps go together (both 0, or both "
                             f"positive), got {self.short_len} and {self.short_steps}")
        if self.short_len:
            self.short().validate()
        if not self.lr > 0:
            raise ValueError(f"Preset.lr must be positive, got {self.lr!r}")
        for name in ("gate_lr_mult", "phi_lr_mult"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"Preset.{name} must be >= 0, got {getattr(self, name)!r}")
        if not self.weight_decay >= 0:
            raise ValueError(f"Preset.weight_decay must be >= 0, got {self.weight_decay!r}")
        if self.task not in TASKS:
            raise ValueError(f"Preset.task must be one of {TASKS}, got {self.task!r}")
        if self.task == "recall":
            self._validate_recall()
        self.nsa_config()

    def _validate_recall(self) -> None:
        if self.num_queries > self.num_facts:
            raise ValueError(f"Preset.num_queries must be <= num_facts={self.num_facts}, got "
                             f"{self.num_queries}")
        if self.num_facts > self.num_keys:
            raise ValueError(f"Preset.num_facts must be <= num_keys={self.num_keys} (keys are "
                             f"distinct within a sequence), got {self.num_facts}")
        if self.num_facts > self.context_len - self.window:
            raise ValueError(f"Preset.num_facts={self.num_facts} facts do not fit before the "
                             f"window: seq_len={self.seq_len} leaves "
                             f"{self.context_len - self.window} positions")


# cpu: each query sees the last w=32 tokens, n=6 selected blocks of 16 (block 0 and the two
# local ones among them) and 31 compressed blocks. The facts lie in ~13 blocks beyond the window
# and only 3 are selected per query, so recall has to learn which ones: the compressed scores
# drive the choice, and phi="mlp" (the paper's) lets compression weight the facts above blanks.
# gpu: the spec's default geometry at 4k context (each query reads 255 + 1024 + 512 of 4096),
# phi="mlp" as on CPU, bf16 autocast. 12 facts fit the 13 freely selected blocks: recall needs
# selection to find the blocks that hold facts. With 32 facts (more than it can select) NSA
# stayed at chance for 1500 steps while dense reached 60% (H100, commit 1b10b29).
PRESETS = {
    "cpu": Preset(seq_len=256, batch_size=16, steps=400, num_layers=2, hidden_size=64,
                  num_heads=2, num_kv_heads=1, head_dim=32, num_keys=8, num_values=8,
                  num_facts=8, num_queries=8, lr=3e-3, warmup=20, eval_every=25,
                  eval_batch_size=32, block_len=16, block_stride=8, sel_block=16, num_sel=6,
                  window=32, phi="mlp"),
    "gpu": Preset(seq_len=4096, batch_size=16, steps=1500, num_layers=4, hidden_size=512,
                  num_heads=8, num_kv_heads=2, head_dim=64, num_keys=16, num_values=16,
                  num_facts=12, num_queries=12, lr=1e-3, warmup=100, eval_every=100,
                  eval_batch_size=64, block_len=32, block_stride=16, sel_block=64, num_sel=16,
                  window=512, phi="mlp", bf16=True),
    # text: byte-level LM; the recall fields are unused (1s)
    "text_cpu": Preset(seq_len=256, batch_size=16, steps=300, num_layers=2, hidden_size=64,
                       num_heads=2, num_kv_heads=1, head_dim=32, num_keys=1, num_values=1,
                       num_facts=1, num_queries=1, lr=3e-3, warmup=20, eval_every=25,
                       eval_batch_size=32, block_len=16, block_stride=8, sel_block=16,
                       num_sel=6, window=32, phi="mlp", task="text"),
    "text_gpu": Preset(seq_len=4096, batch_size=8, steps=600, num_layers=4, hidden_size=512,
                       num_heads=8, num_kv_heads=2, head_dim=64, num_keys=1, num_values=1,
                       num_facts=1, num_queries=1, lr=1e-3, warmup=50, eval_every=50,
                       eval_batch_size=16, block_len=32, block_stride=16, sel_block=64,
                       num_sel=16, window=512, phi="mlp", bf16=True, task="text"),
    "text_gpu_8k": Preset(seq_len=8192, batch_size=4, steps=600, num_layers=4, hidden_size=512,
                          num_heads=8, num_kv_heads=2, head_dim=64, num_keys=1, num_values=1,
                          num_facts=1, num_queries=1, lr=1e-3, warmup=50, eval_every=50,
                          eval_batch_size=8, block_len=32, block_stride=16, sel_block=64,
                          num_sel=16, window=512, phi="mlp", bf16=True, task="text"),
}


# ---- data ------------------------------------------------------------------------------------

def fact_token(p: Preset, key: Tensor, value: Tensor) -> Tensor:
    """The token binding key index k to value index v (query key tokens are 1 + k)."""
    return 1 + p.num_keys + key * p.num_values + value


def _random_subset(generator: torch.Generator, rows: int, n: int, k: int) -> Tensor:
    """Per row, k distinct indices of range(n) in random order."""
    return torch.rand(rows, n, generator=generator).argsort(-1)[:, :k]


@functools.cache
def text_corpus(split: str) -> Tensor:
    """uint8 [N]: the Python standard library's top-level modules, every tenth by name for
    split "eval", the others for "train", joined by newlines."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    chosen = [f for i, f in enumerate(files) if (i % 10 == 0) == (split == "eval")]
    return torch.frombuffer(bytearray(b"\n".join(f.read_bytes() for f in chosen)),
                            dtype=torch.uint8)


def text_batch(p: Preset, batch_size: int, generator: torch.Generator,
               split: str) -> tuple[Tensor, Tensor]:
    """Windows of seq_len + 1 bytes at random offsets of the split; every target is an answer."""
    corpus = text_corpus(split)
    starts = torch.randint(0, corpus.numel() - p.seq_len - 1, (batch_size,), generator=generator)
    tokens = corpus[starts[:, None] + torch.arange(p.seq_len + 1)].long()
    return tokens, torch.ones(batch_size, p.seq_len, dtype=torch.bool)


def make_batch(p: Preset, batch_size: int, generator: torch.Generator,
               split: str = "train") -> tuple[Tensor, Tensor]:
    """One batch: tokens [B, seq_len+1] int64 and answers [B, seq_len] bool (task "text": a
    text_batch of the split; recall draws both splits alike, the seeds keep them apart).

    The context is blank except for num_facts fact tokens at random positions before
    context_len - window. The query section is num_queries (key, fact) pairs for distinct
    facts in random order. answers[b, t] marks the inputs t whose target tokens[b, t+1] is a
    queried fact.

    One blank token rather than varied filler: with 4 filler tokens the cpu preset's dense
    model had not started to recall after 300 steps; with one, it recalls after ~100.
    """
    if p.task == "text":
        return text_batch(p, batch_size, generator, split)
    B, C, P, Q = batch_size, p.context_len, p.num_facts, p.num_queries
    tokens = torch.full((B, p.seq_len + 1), BLANK, dtype=torch.long)
    keys = _random_subset(generator, B, p.num_keys, P)
    facts = fact_token(p, keys, torch.randint(0, p.num_values, (B, P), generator=generator))
    tokens.scatter_(1, _random_subset(generator, B, C - p.window, P), facts)
    asked = _random_subset(generator, B, P, Q)
    query_pos = C + 2 * torch.arange(Q).expand(B, Q)
    tokens.scatter_(1, query_pos, 1 + keys.gather(1, asked))
    tokens.scatter_(1, query_pos + 1, facts.gather(1, asked))
    answers = torch.zeros(B, p.seq_len, dtype=torch.bool)
    answers.scatter_(1, query_pos, True)
    return tokens, answers


# ---- model -----------------------------------------------------------------------------------

class DenseAttention(AttentionProjections):
    """The baseline: NSAAttention's projections, RoPE and GQA, with full causal attention."""

    def forward(self, x: Tensor) -> Tensor:
        c = self.config
        group = self.context_parallel_group
        if group is None:
            q, k, v = self._qkv(x, torch.arange(x.shape[1], device=x.device))
            mask = None
        else:
            pos = self._shard_positions(x.shape[1], x.device)
            q, k, v = self._qkv(x, pos)
            k, v = cp.gather_tokens(k, group), cp.gather_tokens(v, group)
            # this rank's queries sit at two separate stretches of the sequence
            mask = pos[:, None] >= torch.arange(k.shape[1], device=x.device)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), attn_mask=mask,
                                           is_causal=mask is None, enable_gqa=True,
                                           scale=c.scale)
        return self.o_proj(o.transpose(1, 2).flatten(-2))


class Block(nn.Module):
    def __init__(self, attn: nn.Module, hidden: int, mlp_ratio: int):
        super().__init__()
        self.attn_norm = nn.RMSNorm(hidden)
        self.attn = attn
        self.mlp_norm = nn.RMSNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, mlp_ratio * hidden, bias=False), nn.GELU(),
                                 nn.Linear(mlp_ratio * hidden, hidden, bias=False))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


def _attention(p: Preset, attention: str, seed: int) -> nn.Module:
    """An attention layer drawn from its own RNG stream: NSA's gate MLP draws numbers the dense
    layer does not, and the layers after it must still start equal in both models. Both create
    q/k/v/o first (AttentionProjections), so those start equal too."""
    layer = NSAAttention if attention == "nsa" else DenseAttention
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return layer(p.nsa_config())


class TinyLM(nn.Module):
    """Decoder-only LM: embedding, pre-norm blocks, final norm, LM head."""

    def __init__(self, p: Preset, attention: str, seed: int = 0):
        super().__init__()
        if attention not in MODELS:
            raise ValueError(f"attention must be one of {MODELS}, got {attention!r}")
        self.embed = nn.Embedding(p.vocab_size, p.hidden_size)
        self.blocks = nn.ModuleList(Block(_attention(p, attention, seed + 1 + i),
                                          p.hidden_size, p.mlp_ratio)
                                    for i in range(p.num_layers))
        self.norm = nn.RMSNorm(p.hidden_size)
        self.head = nn.Linear(p.hidden_size, p.vocab_size, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_model(p: Preset, attention: str, seed: int) -> TinyLM:
    """attention "nsa" or "dense"; equal seeds give equal weights wherever the two coincide."""
    torch.manual_seed(seed)
    return TinyLM(p, attention, seed)


def param_groups(model: nn.Module, p: Preset) -> list[dict]:
    """AdamW groups: NSA's gate MLPs at p.gate_lr_mult x lr, its phi MLPs at p.phi_lr_mult x lr,
    the rest at lr (empty groups dropped)."""
    groups = {"gate": [], "phi": [], "rest": []}
    for layer in model.modules():
        if isinstance(layer, NSAAttention):
            groups["gate"] += layer.gate.parameters()
            for phi in (layer.phi_k, layer.phi_v):
                if isinstance(phi, nn.Module):
                    groups["phi"] += phi.parameters()
    special = {id(t) for t in groups["gate"] + groups["phi"]}
    groups["rest"] = [t for t in model.parameters() if id(t) not in special]
    mult = {"gate": p.gate_lr_mult, "phi": p.phi_lr_mult, "rest": 1.0}
    return [{"params": params, "lr": p.lr * mult[name], "name": name}
            for name, params in groups.items() if params]


def answer_sums(logits: Tensor, targets: Tensor, answers: Tensor) -> tuple[Tensor, Tensor]:
    """(summed cross-entropy, number right) over the answers; logits [B,T,V], targets [B,T]."""
    picked = logits[answers].float()
    wanted = targets[answers]
    return F.cross_entropy(picked, wanted, reduction="sum"), (picked.argmax(-1) == wanted).sum()


# ---- ranks -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Ranks:
    """The processes a run trains on: this one alone (mesh None), or the ranks of a torchrun
    launch, which split every batch's rows, or with context_parallel its sequences' tokens."""
    world: int = 1
    rank: int = 0
    mesh: Optional[object] = None  # a 1-D DeviceMesh over the ranks
    context_parallel: bool = False

    def share(self, tokens: Tensor, answers: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """This rank's (inputs, targets, answers) of a batch: tokens [B, T+1], answers [B, T]."""
        parts = tokens[:, :-1], tokens[:, 1:], answers
        if self.context_parallel:
            return tuple(cp.shard(t, self.mesh.get_group()) for t in parts)
        rows = len(tokens) // self.world
        return tuple(t[self.rank * rows:(self.rank + 1) * rows] for t in parts)

    def sum(self, x: Tensor) -> Tensor:
        """x summed over the ranks, in place."""
        if self.mesh is not None:
            dist.all_reduce(x, group=self.mesh.get_group())
        return x

    def distribute(self, model: TinyLM) -> TinyLM:
        """The model sharded over the ranks with FSDP2, its attention context-parallel when the
        ranks split tokens; unchanged for one process."""
        if self.mesh is None:
            return model
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks:
            if self.context_parallel:
                block.attn.context_parallel_group = self.mesh.get_group()
            fully_shard(block, mesh=self.mesh)
        return fully_shard(model, mesh=self.mesh)


def _world_size() -> Optional[int]:
    """The number of ranks of the torchrun launch this process belongs to; None outside one."""
    return int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None


def check_launch(p: Preset, device: Union[str, torch.device, None],
                 context_parallel: bool) -> None:
    """Raise ValueError naming what this launch (torchrun or a lone process) cannot run."""
    world = _world_size()
    if world is None:
        if context_parallel:
            raise ValueError("context_parallel needs a torchrun launch: torchrun "
                             "--nproc_per_node N -m nsa_ops.train --context-parallel")
        return
    dev = torch.device(device or "cpu")
    if dev.type not in ("cuda", "cpu") or dev.index is not None:
        raise ValueError(f"device must be cuda or cpu under torchrun (each rank takes "
                         f"cuda:LOCAL_RANK), got {device!r}")
    if context_parallel:
        if p.seq_len % (2 * world):
            raise ValueError(f"Preset.seq_len={p.seq_len} must be divisible by 2 * {world} ranks "
                             f"for the context-parallel (zigzag) split")
        return
    for name in ("batch_size", "eval_batch_size"):
        if getattr(p, name) % world:
            raise ValueError(f"Preset.{name}={getattr(p, name)} must be divisible by the {world} "
                             f"ranks that split its rows")


def _join(device: Union[str, torch.device, None], context_parallel: bool
          ) -> tuple[Ranks, torch.device]:
    """This process's ranks and device. Under torchrun it joins the process group, unless an
    earlier call did: NCCL on cuda:LOCAL_RANK, or gloo on the CPU."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    world = _world_size()
    if world is None:
        return Ranks(), device
    from torch.distributed.device_mesh import init_device_mesh
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return Ranks(world, dist.get_rank(), init_device_mesh(device.type, (world,)),
                 context_parallel), device


# ---- training --------------------------------------------------------------------------------

def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warmup to 1, then cosine decay to 0.1 at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))


def _autocast(p: Preset, device: torch.device):
    if p.bf16 and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


def train_step(model: TinyLM, opt: torch.optim.Optimizer, batch: tuple[Tensor, Tensor],
               p: Preset, device: torch.device, ranks: Ranks = Ranks()) -> Tensor:
    """One AdamW step on the answer loss of the batch (tokens, answers); returns this rank's
    share of that loss (the ranks' shares sum to it), detached and not synchronised."""
    inputs, targets, answers = (t.to(device) for t in ranks.share(*batch))
    with _autocast(p, device):
        logits = model(inputs)
    share = answer_sums(logits, targets, answers)[0] / int(batch[1].sum())
    opt.zero_grad(set_to_none=True)
    # FSDP averages the ranks' gradients, and the loss is the sum of the ranks' shares
    (share * ranks.world).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return share.detach()


@torch.no_grad()
def evaluate(model: TinyLM, batch: tuple[Tensor, Tensor], p: Preset, device: torch.device,
             ranks: Ranks = Ranks()) -> tuple[float, float]:
    """(answer loss, answer accuracy) on a held-out batch."""
    model.eval()
    inputs, targets, answers = (t.to(device) for t in ranks.share(*batch))
    with _autocast(p, device):
        logits = model(inputs)
    model.train()
    loss, right = answer_sums(logits, targets, answers)
    total = ranks.sum(torch.stack([loss, right.to(loss.dtype)])) / int(batch[1].sum())
    return tuple(total.tolist())


@torch.no_grad()
def recall_diagnostics(model: TinyLM, batch: tuple[Tensor, Tensor], p: Preset,
                       device: torch.device) -> dict[str, float]:
    """Why NSA does or does not recall, on the eval batch, averaged over its NSA layers: sel_hit,
    the fraction of (answer query, KV head) whose selected blocks hold the queried fact;
    cmp_mass, the compressed attention probability (mean over query heads) on the compressed
    blocks covering the fact; gate_<branch>, the mean gate of each branch at the answer queries."""
    tokens, answers = (t.to(device) for t in batch)
    layers = [m for m in model.modules() if isinstance(m, NSAAttention)]
    seen = []
    hooks = [m.register_forward_hook(lambda m, args, out: seen.append(args[0])) for m in layers]
    model.eval()
    try:
        with _autocast(p, device):
            model(tokens[:, :-1])
    finally:
        model.train()
        for h in hooks:
            h.remove()
    B, T = answers.shape
    rows, cols = answers.nonzero(as_tuple=True)  # [A] answer query positions
    fact = tokens[rows, cols + 1]
    fact_pos = (tokens[rows, :p.context_len] == fact[:, None]).float().argmax(1)
    l, d, lp = p.block_len, p.block_stride, p.sel_block
    sums = dict.fromkeys(("sel_hit", "cmp_mass", "gate_cmp", "gate_sel", "gate_win"), 0.0)
    for layer, x in zip(layers, seen):
        c = layer.config
        x = x.to(layer.q_proj.weight.dtype)  # autocast may have handed the layer bf16
        q, k, v = layer._qkv(x, torch.arange(T, device=device))
        q, k, v = q.float(), k.float(), v.float()
        k_cmp, v_cmp = layer.phi_k(k, l, d, None), layer.phi_v(v, l, d, None)
        _, lse = reference.compressed_attention(q, k_cmp, v_cmp, l, d, c.scale)
        idx = reference.select_blocks(q, k_cmp, lse, l, d, lp, c.num_sel, c.scale)
        sums["sel_hit"] += (idx[rows, cols] == (fact_pos // lp)[:, None, None]).any(-1) \
            .float().mean().item()
        kv = torch.arange(c.num_heads, device=device) // c.group
        logits = torch.einsum("ahd,ahnd->ahn", q[rows, cols], k_cmp[rows][:, :, kv]
                              .transpose(1, 2)) * c.scale
        starts = torch.arange(k_cmp.shape[1], device=device) * d
        visible = starts + l - 1 <= cols[:, None]
        covers = (starts <= fact_pos[:, None]) & (fact_pos[:, None] < starts + l) & visible
        # where, not a product: the logits of blocks a query cannot see may overflow exp
        probs = torch.where(visible[:, None], torch.exp(logits - lse[rows, cols][..., None]), 0.0)
        sums["cmp_mass"] += (probs * covers[:, None]).sum(-1).mean().item()
        for name, g in zip(("gate_cmp", "gate_sel", "gate_win"), layer.gates(x[rows, cols][:, None])):
            sums[name] += g.float().mean().item()
    return {name: total / len(layers) for name, total in sums.items()}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Progress:
    """A tqdm bar when tqdm is importable, else a line per evaluation; nothing unless show."""

    def __init__(self, total: int, name: str, show: bool):
        self.total, self.name, self.show, self.bar = total, name, show, None
        try:
            from tqdm import tqdm
        except ImportError:
            return
        if show:
            self.bar = tqdm(total=total, desc=name, unit="step")

    def update(self, row: Optional[dict]) -> None:
        if self.bar is not None:
            self.bar.update(1)
            if row is not None:
                self.bar.set_postfix(loss=f"{row['eval_loss']:.3f}",
                                     acc=f"{row['eval_answer_acc']:.3f}")
        elif row is not None and self.show:
            print(f"{self.name:5s} step {row['step']:5d}/{self.total}  train loss "
                  f"{row['train_loss']:.4f}  eval loss {row['eval_loss']:.4f}  answer acc "
                  f"{row['eval_answer_acc']:.3f}  {row['elapsed_s']:.0f}s", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def train_model(p: Preset, attention: str, device: torch.device, seed: int,
                ranks: Ranks = Ranks()) -> list[dict]:
    """Train one model; a CSV row per evaluation (train_loss: mean over the steps since the
    previous row)."""
    model = ranks.distribute(build_model(p, attention, seed).to(device))
    opt = torch.optim.AdamW(param_groups(model, p), lr=p.lr, weight_decay=p.weight_decay,
                            betas=(0.9, 0.95))
    schedule = functools.partial(lr_factor, warmup=p.warmup, total=p.steps)

    def gate_schedule(step: int) -> float:
        return 0.0 if step < p.gate_hold else schedule(step)

    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, [gate_schedule if g["name"] == "gate" else schedule for g in opt.param_groups])
    data = torch.Generator().manual_seed(seed)
    eval_batch = make_batch(p, p.eval_batch_size,
                            torch.Generator().manual_seed(seed + EVAL_SEED_OFFSET), "eval")
    progress = _Progress(p.steps, attention, show=ranks.rank == 0)
    rows, running, since, train_s = [], torch.zeros((), device=device), 0, 0.0
    for step in range(1, p.steps + 1):
        start = time.perf_counter()
        batch = make_batch(p.at_step(step), p.batch_size, data)
        running += train_step(model, opt, batch, p, device, ranks)
        sched.step()
        since += 1
        due = step % p.eval_every == 0 or step == p.steps
        if due:
            _sync(device)  # CUDA steps run ahead; the wait lands in this interval's time
        train_s += time.perf_counter() - start
        row = None
        if due:
            eval_loss, acc = evaluate(model, eval_batch, p, device, ranks)
            row = dict(step=step, model=attention, train_loss=ranks.sum(running).item() / since,
                       eval_loss=eval_loss, eval_answer_acc=acc, elapsed_s=train_s)
            if attention == "nsa" and p.task == "recall" and ranks.world == 1:
                row.update(recall_diagnostics(model, eval_batch, p, device))
            rows.append(row)
            running.zero_()
            since = 0
        progress.update(row)
    progress.close()
    return rows


# ---- reporting -------------------------------------------------------------------------------

def run_header(device: torch.device, preset_name: str, ranks: Ranks = Ranks()) -> str:
    """What a committed result names: device, versions, commit, preset, ranks."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"{device.type} ({platform.machine()}, {torch.get_num_threads()} threads)"
    split = "" if ranks.mesh is None else \
        f" ranks={ranks.world} split={'tokens' if ranks.context_parallel else 'rows'}"
    return (f"device={name} torch={torch.__version__} commit={commit()} "
            f"python={platform.python_version()} preset={preset_name}{split}")


def plot(rows: list[dict], path: Path, title: str, chance: float) -> bool:
    """Answer loss and accuracy per model; False, with a hint, when matplotlib is missing."""
    try:
        fig, (loss_ax, acc_ax) = new_figure(1, 2, figsize=(11, 4.2))
    except ImportError:
        print(f"matplotlib is not installed, so {path.name} was not drawn: "
              f"pip install matplotlib (or pip install 'nsa-ops[train]')")
        return False
    for i, name in enumerate(dict.fromkeys(r["model"] for r in rows)):
        mine = [r for r in rows if r["model"] == name]
        steps = [r["step"] for r in mine]
        color = f"C{i}"
        loss_ax.plot(steps, [r["train_loss"] for r in mine], "--", color=color, alpha=0.6,
                     label=f"{name} train")
        loss_ax.plot(steps, [r["eval_loss"] for r in mine], "-", color=color, marker=".",
                     label=f"{name} eval")
        acc_ax.plot(steps, [r["eval_answer_acc"] for r in mine], "-", color=color, marker=".",
                    label=name)
    acc_ax.axhline(chance, color="gray", linestyle=":", label="chance")
    loss_ax.set_ylabel("answer cross-entropy (text: per byte)")
    acc_ax.set_ylabel("eval answer accuracy (text: next byte)")
    acc_ax.set_ylim(-0.02, 1.02)
    for ax in (loss_ax, acc_ax):
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        ax.legend()
    save_figure(fig, path, title, fontsize=8)
    return True


def summary(rows: list[dict], params: dict[str, int]) -> str:
    lines = [f"{'model':6s} {'params':>8s} {'eval loss':>10s} {'answer acc':>11s} {'train s':>8s}"]
    for name, count in params.items():
        last = [r for r in rows if r["model"] == name][-1]
        lines.append(f"{name:6s} {count:8d} {last['eval_loss']:10.4f} "
                     f"{last['eval_answer_acc']:11.3f} {last['elapsed_s']:8.1f}")
    return "\n".join(lines)


# ---- entry points ----------------------------------------------------------------------------

def resolve_preset(preset: Union[str, Preset], steps: Optional[int] = None) -> Preset:
    """A preset by name or as given, with steps (and warmup, eval_every) capped to steps."""
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ValueError(f"preset must be one of {tuple(PRESETS)}, got {preset!r}")
        preset = PRESETS[preset]
    elif not isinstance(preset, Preset):
        raise ValueError(f"preset must be a preset name or a Preset, got "
                         f"{type(preset).__name__}")
    if steps is not None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps <= 0:
            raise ValueError(f"steps must be a positive int, got {steps!r}")
        preset = dataclasses.replace(preset, steps=steps, warmup=min(preset.warmup, steps),
                                     eval_every=min(preset.eval_every, steps))
    preset.validate()
    return preset


def _check_seed(seed) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")


def run(preset: Union[str, Preset] = "cpu", steps: Optional[int] = None,
        device: Union[str, torch.device, None] = None, out: Union[str, Path, None] = None,
        seed: int = 0, context_parallel: bool = False) -> list[dict]:
    """Train NSA, then dense, on the same data; write the CSV (and PNG) into out; return the
    CSV rows. out defaults to bench/results/train_<preset>. Under torchrun every rank calls
    this (see the module doc); context_parallel splits tokens instead of batch rows. The process
    group it joins stays up for later calls (re-joining after destroy_process_group hung on gloo,
    torch 2.13): main(), or the caller, destroys it."""
    name = preset if isinstance(preset, str) else "custom"
    p = resolve_preset(preset, steps)
    _check_seed(seed)
    check_launch(p, device, context_parallel)
    ranks, device = _join(device, context_parallel)
    lead = ranks.rank == 0
    out = Path(out or f"bench/results/train_{name}")
    header = run_header(device, name, ranks)
    if lead:
        print(header)
        task = (f"bytes of the Python standard library, {p.seq_len} per sequence"
                if p.task == "text" else
                f"{p.num_facts} facts ({p.num_keys} keys x {p.num_values} values) in "
                f"{p.seq_len} tokens, {p.num_queries} queries")
        print(f"{task}; {p.num_layers} layers, hidden {p.hidden_size}; {p.steps} steps of "
              f"{p.batch_size}")
    start = time.perf_counter()
    rows, params = [], {}
    for attention in MODELS:
        rows += train_model(p, attention, device, seed, ranks)
        params[attention] = sum(t.numel() for t in build_model(p, attention, seed).parameters())
    wall = time.perf_counter() - start
    if lead:
        write_csv(out / "train_loss.csv", rows, header, CSV_FIELDS)
        plotted = plot(rows, out / "train_loss.png", header, chance=p.chance)
        print(summary(rows, params))
        print(f"wall time {wall:.1f}s (both models, with evaluation); wrote "
              f"{out / 'train_loss.csv'}" + (f" and {out / 'train_loss.png'}" if plotted else ""))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nsa_ops.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=tuple(PRESETS), default="cpu")
    parser.add_argument("--steps", type=int, default=None, help="override the preset's steps")
    parser.add_argument("--device", default=None,
                        help="default: cuda if available, else cpu (under torchrun: cuda or cpu, "
                             "each rank on cuda:LOCAL_RANK)")
    parser.add_argument("--out", default=None, help="default: bench/results/train_<preset>")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--context-parallel", action="store_true",
                        help="under torchrun: the ranks split each sequence's tokens, not the "
                             "batch's rows")
    parser.add_argument("--force-branch", choices=("cmp", "sel", "win"), default=None,
                        help="ablation: NSA keeps only this branch (NSAConfig.force_branch)")
    parser.add_argument("--gate-act", choices=("sigmoid", "softmax"), default=None,
                        help="NSA's gate activation (NSAConfig.gate_act; default: the preset's)")
    parser.add_argument("--gate-lr-mult", type=float, default=None,
                        help="learning-rate multiplier of NSA's gate MLP (default: the preset's)")
    parser.add_argument("--phi-lr-mult", type=float, default=None,
                        help="learning-rate multiplier of NSA's phi MLPs (default: the preset's)")
    parser.add_argument("--short-len", type=int, default=None,
                        help="length curriculum: the first --short-steps steps train on "
                             "sequences of this many tokens")
    parser.add_argument("--short-steps", type=int, default=None)
    parser.add_argument("--gate-hold", type=int, default=None,
                        help="NSA's gate MLPs do not learn for this many first steps")
    args = parser.parse_args(argv)
    changes = {name: value for name, value in (("force_branch", args.force_branch),
                                               ("gate_act", args.gate_act),
                                               ("gate_lr_mult", args.gate_lr_mult),
                                               ("phi_lr_mult", args.phi_lr_mult),
                                               ("short_len", args.short_len),
                                               ("short_steps", args.short_steps),
                                               ("gate_hold", args.gate_hold))
               if value is not None}
    if changes:
        suffix = "_".join(value if isinstance(value, str) else f"{name.replace('_', '')}{value:g}"
                          for name, value in changes.items())
        args.out = args.out or f"bench/results/train_{args.preset}_{suffix}"
        args.preset = dataclasses.replace(PRESETS[args.preset], **changes)
    try:
        check_launch(resolve_preset(args.preset, args.steps), args.device, args.context_parallel)
        _check_seed(args.seed)
    except ValueError as e:
        parser.error(str(e))
    try:
        run(args.preset, args.steps, args.device, args.out, args.seed, args.context_parallel)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
