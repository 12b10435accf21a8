"""The training showcase (nsa_ops.train): data, models, loop, CSV/PNG output, argument errors,
torchrun launches (data and context parallel) against the single-process run."""
import csv
import dataclasses
import math
import os
import signal
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import nsa_ops
from nsa_ops import train

MICRO = dataclasses.replace(
    train.PRESETS["cpu"], seq_len=64, batch_size=4, steps=4, num_layers=1, hidden_size=32,
    num_heads=2, num_kv_heads=1, head_dim=16, num_keys=6, num_values=4, num_facts=4,
    num_queries=3, warmup=2, eval_every=2, eval_batch_size=4, block_len=8, block_stride=4,
    sel_block=8, num_sel=3, window=16)
NSA_OPS = {"compressed_attention", "select_blocks", "selection_attention",
           "sliding_window_attention"}


def batch(seed, p=MICRO, size=8):
    return train.make_batch(p, size, torch.Generator().manual_seed(seed))


def recall(p, tokens, answers):
    """Answer every query from the context alone: the fact whose key is the queried key."""
    first_fact = 1 + p.num_keys
    out = []
    for row, marks in zip(tokens, answers):
        context = row[:p.context_len]
        facts = context[context >= first_fact]
        for t in marks.nonzero().flatten().tolist():
            key = row[t].item() - 1
            match = facts[(facts - first_fact) // p.num_values == key]
            assert len(match) == 1, f"key {key} is in the context {len(match)} times"
            out.append(match.item())
    return torch.tensor(out)


def test_batches_are_deterministic_per_seed():
    a, b, c = batch(0), batch(0), batch(1)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_answers_are_recoverable_from_the_context_only():
    p = MICRO
    tokens, answers = batch(3)
    assert tokens.shape == (8, p.seq_len + 1) and answers.shape == (8, p.seq_len)
    assert int(answers.sum()) == 8 * p.num_queries
    targets = tokens[:, 1:][answers]
    assert torch.equal(recall(p, tokens, answers), targets)
    # every fact lies beyond the sliding window of every query
    facts_at = (tokens[:, :p.context_len] > p.num_keys).nonzero()[:, 1]
    assert int(facts_at.max()) < p.context_len - p.window
    assert int((tokens > p.num_keys).sum()) == 8 * (p.num_facts + p.num_queries)


@pytest.mark.parametrize("attention", train.MODELS)
def test_training_on_a_fixed_batch_reduces_the_loss(attention):
    torch.manual_seed(0)
    model = train.build_model(MICRO, attention, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fixed = batch(5)
    losses = [train.train_step(model, opt, fixed, MICRO, torch.device("cpu")).item()
              for _ in range(12)]
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.5 * losses[0], losses


def test_lr_split_moves_gate_and_phi_at_their_own_rates():
    """gate_lr_mult=0 freezes the gate MLPs; phi and the rest take their own learning rates."""
    p = dataclasses.replace(MICRO, phi="mlp", gate_lr_mult=0.0, phi_lr_mult=3.0)
    model = train.build_model(p, "nsa", seed=0)
    groups = train.param_groups(model, p)
    assert [g["lr"] for g in groups] == [0.0, 3 * p.lr, p.lr]
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    before = {name: t.detach().clone() for name, t in model.named_parameters()}
    opt = torch.optim.AdamW(groups, lr=p.lr)
    for seed in range(2):
        train.train_step(model, opt, batch(seed), p, torch.device("cpu"))
    moved = {name for name, t in model.named_parameters() if not torch.equal(t, before[name])}
    assert not any(".gate." in name for name in moved), moved
    assert any(".phi_k." in name for name in moved) and any(".q_proj." in name for name in moved)


@pytest.mark.parametrize("steps, gate_moves", [(2, False), (3, True)])
def test_length_curriculum_and_gate_hold(steps, gate_moves, monkeypatch):
    """The first short_steps batches are short_len tokens long (evaluation stays at seq_len),
    and the gate MLPs do not move during the first gate_hold steps."""
    p = dataclasses.replace(MICRO, phi="mlp", steps=steps, short_len=32, short_steps=2,
                            gate_hold=2)
    lengths, models = [], []
    make_batch, build_model = train.make_batch, train.build_model
    monkeypatch.setattr(train, "make_batch", lambda q, *a, **k: lengths.append(q.seq_len)
                        or make_batch(q, *a, **k))
    monkeypatch.setattr(train, "build_model", lambda *a: models.append(build_model(*a))
                        or models[-1])
    train.train_model(p, "nsa", torch.device("cpu"), seed=0)
    assert lengths == [64, 32, 32, 64][:steps + 1]
    fresh = dict(build_model(p, "nsa", 0).named_parameters())
    moved = {name for name, t in models[0].named_parameters() if not torch.equal(t, fresh[name])}
    assert any(".gate." in name for name in moved) == gate_moves, moved
    assert any(".q_proj." in name for name in moved)


class OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "nsa":
            self.names.add(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("attention", train.MODELS)
def test_only_the_nsa_model_runs_torch_ops_nsa(attention):
    model = train.build_model(MICRO, attention, seed=0)
    layer = nsa_ops.NSAAttention if attention == "nsa" else train.DenseAttention
    assert all(type(block.attn) is layer for block in model.blocks)
    tokens, answers = batch(0, size=2)
    with OpRecorder() as rec:
        train.answer_sums(model(tokens[:, :-1]), tokens[:, 1:], answers)[0].backward()
    if attention == "nsa":
        assert NSA_OPS <= rec.names, rec.names
        assert any(name.endswith("_backward") for name in rec.names), rec.names
    else:
        assert not rec.names


def test_shared_layers_start_equal():
    nsa, dense = (train.build_model(MICRO, a, seed=0).state_dict() for a in train.MODELS)
    shared = set(nsa) & set(dense)
    assert {k for k in dense if "q_proj" in k} <= shared
    for key in shared:
        assert torch.equal(nsa[key], dense[key]), key


def read_csv(path):
    with open(path) as f:
        header = f.readline()
        return header, list(csv.DictReader(f))


def test_run_writes_csv_and_png(tmp_path):
    rows = train.run(MICRO, out=tmp_path)
    header, written = read_csv(tmp_path / "train_loss.csv")
    assert header.startswith("# device=") and "torch=" in header and "commit=" in header
    assert list(written[0]) == list(train.CSV_FIELDS)
    assert [(r["model"], int(r["step"])) for r in written] == \
        [(m, s) for m in train.MODELS for s in (2, 4)]
    assert len(rows) == len(written)
    for r in written:
        for key in ("train_loss", "eval_loss", "eval_answer_acc", "elapsed_s"):
            assert math.isfinite(float(r[key])), (key, r)
        assert 0 <= float(r["eval_answer_acc"]) <= 1
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "train_loss.png").stat().st_size > 0


def test_run_without_matplotlib_still_writes_the_csv(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    train.run(MICRO, steps=1, out=tmp_path)
    assert (tmp_path / "train_loss.csv").exists()
    assert not (tmp_path / "train_loss.png").exists()
    assert "pip install matplotlib" in capsys.readouterr().out


@pytest.mark.parametrize("kwargs, name", [
    (dict(preset="huge"), "preset"),
    (dict(preset=MICRO, steps=0), "steps"),
    (dict(preset=MICRO, seed=-1), "seed"),
    (dict(preset=dataclasses.replace(MICRO, num_queries=5)), "Preset.num_queries"),
    (dict(preset=dataclasses.replace(MICRO, num_facts=7)), "Preset.num_facts"),
    (dict(preset=dataclasses.replace(MICRO, hidden_size=0)), "Preset.hidden_size"),
    (dict(preset=dataclasses.replace(MICRO, block_stride=3)), "NSAConfig.block_stride"),
    (dict(preset=MICRO, context_parallel=True), "context_parallel"),
    (dict(preset=dataclasses.replace(MICRO, gate_lr_mult=-1.0)), "Preset.gate_lr_mult"),
    (dict(preset=dataclasses.replace(MICRO, short_len=32)), "Preset.short_len and short_steps"),
    (dict(preset=dataclasses.replace(MICRO, short_len=20, short_steps=2)), "Preset.num_facts"),
    (dict(preset=dataclasses.replace(MICRO, gate_hold=-1)), "Preset.gate_hold"),
])
def test_bad_arguments_name_the_argument(kwargs, name, tmp_path):
    with pytest.raises(ValueError, match=name):
        train.run(out=tmp_path, **kwargs)


def test_cli_rejects_bad_steps(capsys):
    with pytest.raises(SystemExit):
        train.main(["--steps", "0"])
    assert "steps must be a positive int" in capsys.readouterr().err


@pytest.mark.parametrize("flags, name", [
    ([], "Preset.batch_size"),
    (["--context-parallel"], "Preset.seq_len"),
    (["--device", "cuda:1"], "device"),
])
def test_cli_rejects_what_three_ranks_cannot_split(flags, name, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(SystemExit):
        train.main(["--steps", "1", *flags])
    assert name in capsys.readouterr().err


def test_torchrun_two_ranks_equal_one_process(tmp_path):
    """Two gloo ranks under torchrun, FSDP2, splitting the batch's rows, then each sequence's
    tokens (one launch, as every launch pays seconds of imports): the first step's loss, and the
    evaluation after its update, equal the single-process run's."""
    code = ("import torch.distributed as dist\n"
            "from nsa_ops.train import Preset, run\n"
            "for split in ('rows', 'tokens'):\n"
            f"    run({MICRO!r}, steps=1, out={str(tmp_path)!r} + '/' + split,\n"
            "        context_parallel=split == 'tokens')\n"
            # both ranks past their last collective before either tears gloo down: one CI run
            # (b57a835) saw rank 1 abort at exit ("terminate called without an active
            # exception") after both splits had finished
            "dist.barrier()\n"
            "dist.destroy_process_group()\n")
    with subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "2", "--no-python", sys.executable, "-c", code],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as launch:
        try:
            out, err = launch.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            # killing the launcher alone would leave its ranks running
            os.killpg(launch.pid, signal.SIGKILL)
            raise
    assert launch.returncode == 0, out[-2000:] + err[-4000:]
    assert out.count("wall time") == 2, out  # rank 0 alone prints
    want = train.run(MICRO, steps=1, out=tmp_path / "one_process")
    for split in ("rows", "tokens"):
        header, rows = read_csv(tmp_path / split / "train_loss.csv")
        assert f"ranks=2 split={split}" in header
        assert [r["model"] for r in rows] == [r["model"] for r in want]
        for got, expected in zip(rows, want):
            for key in ("train_loss", "eval_loss", "eval_answer_acc"):
                assert float(got[key]) == pytest.approx(expected[key], rel=1e-5), \
                    (split, key, got, expected)


TEXT_MICRO = dataclasses.replace(train.PRESETS["text_cpu"], seq_len=64, batch_size=4, steps=4,
                                 num_layers=1, hidden_size=32, head_dim=16, warmup=2,
                                 eval_every=2, eval_batch_size=4, block_len=8, block_stride=4,
                                 sel_block=8, num_sel=3, window=16)


def test_text_task_reads_held_out_modules_and_trains(tmp_path):
    """Byte LM on the standard library: the eval split is other modules than the training one;
    every byte is a target; a few steps of both models write finite losses."""
    train_bytes, eval_bytes = train.text_corpus("train"), train.text_corpus("eval")
    assert train_bytes.numel() > 10 * TEXT_MICRO.seq_len < eval_bytes.numel()
    probe = bytes(eval_bytes[:2000].tolist())
    assert probe not in bytes(train_bytes.tolist())
    tokens, answers = train.make_batch(TEXT_MICRO, 3, torch.Generator().manual_seed(1), "eval")
    assert tokens.shape == (3, 65) and answers.all() and tokens.max() < 256
    rows = train.run(TEXT_MICRO, device="cpu", out=tmp_path)
    assert [r["model"] for r in rows] == ["nsa", "nsa", "dense", "dense"]
    assert all(math.isfinite(r["eval_loss"]) and r["eval_loss"] < math.log(256) + 1
               for r in rows)
    assert (tmp_path / "train_loss.csv").exists()


def test_recall_diagnostics_find_the_fact():
    """sel_hit / cmp_mass are fractions; a layer whose selection is forced onto every block (n
    as large as the block count) holds every fact, so sel_hit is 1."""
    p = dataclasses.replace(MICRO, num_sel=8)  # 64 / 8 = 8 blocks
    model = train.build_model(p, "nsa", 0)
    d = train.recall_diagnostics(model, batch(3, p), p, torch.device("cpu"))
    assert d["sel_hit"] == 1.0
    assert 0 < d["cmp_mass"] <= 1
    assert all(0 < d[f"gate_{b}"] < 1 for b in ("cmp", "sel", "win"))
    d = train.recall_diagnostics(train.build_model(MICRO, "nsa", 0), batch(3), MICRO,
                                 torch.device("cpu"))
    assert 0 <= d["sel_hit"] < 1
