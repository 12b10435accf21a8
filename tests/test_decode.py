"""Decode through NSACache equals prefill at every position; the read counter equals reads(S)."""
import pytest
import torch

from nsa_ops import NSAAttention, NSACache, NSAConfig, reference
from nsa_ops.decode import decode_attention

# l=16, d=8, l'=16, n=4, w=24: T=300 crosses every cmp / selection / window boundary many times
CFG = dict(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim_qk=8, head_dim_v=12,
           block_len=16, block_stride=8, sel_block=16, num_sel=4, window=24)
T = 300


def layer(phi="mean", gate_act="sigmoid", seed=0):
    torch.manual_seed(seed)
    m = NSAAttention(NSAConfig(**CFG, phi=phi, gate_act=gate_act)).double()
    # move off the initial point so every branch and the phi MLP matter
    with torch.no_grad():
        for p in list(m.gate[-1].parameters()) + (
                list(m.phi_k.parameters()) + list(m.phi_v.parameters()) if phi == "mlp" else []):
            p.normal_(0, 0.3)
    return m


def inputs(B, seed=1):
    return torch.randn(B, T, CFG["hidden_size"], dtype=torch.float64,
                       generator=torch.Generator().manual_seed(seed))


def decode(m, x, cache, chunks):
    """Feed x in the given chunk sizes; returns outputs and per-row read counts."""
    outs, reads, t = [], [], 0
    for n in chunks:
        outs.append(m(x[:, t:t + n], cache))
        reads.append(cache.last_reads)
        t += n
    return torch.cat(outs, 1), torch.cat(reads)


def chunk_sizes(seed):
    g = torch.Generator().manual_seed(seed)
    sizes, t = [], 0
    while t < T:
        sizes.append(min(T - t, int(torch.randint(3, 8, (), generator=g))))
        t += sizes[-1]
    return sizes


def expected_reads(c):
    return torch.tensor([c.reads(S) for S in range(1, T + 1)])


@pytest.mark.parametrize("phi, gate_act, B", [("mean", "sigmoid", 1), ("mlp", "softmax", 2)])
def test_token_by_token_equals_prefill(phi, gate_act, B):
    m, x = layer(phi, gate_act), inputs(B)
    with torch.no_grad():
        ref = m(x)
        cache = m.new_cache(B)
        out, reads = decode(m, x, cache, [1] * T)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    assert torch.equal(reads, expected_reads(m.config))
    assert int(cache.total_reads) == int(expected_reads(m.config).sum())


@pytest.mark.parametrize("seed", [0, 1])
def test_chunks_equal_prefill(seed):
    m, x = layer("mlp" if seed else "mean"), inputs(2, seed)
    with torch.no_grad():
        ref = m(x)
        out, reads = decode(m, x, m.new_cache(2), chunk_sizes(seed))
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    assert torch.equal(reads, expected_reads(m.config))


def test_whole_prompt_then_tokens():
    m, x = layer(), inputs(1)
    with torch.no_grad():
        ref = m(x)
        out, reads = decode(m, x, m.new_cache(1, capacity=T), [T - 40] + [1] * 40)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    assert torch.equal(reads, expected_reads(m.config))


def test_cache_emits_compressed_rows_on_schedule():
    m, x = layer("mlp"), inputs(1)
    c = m.config
    with torch.no_grad():
        cache = m.new_cache(1)
        for t in range(T):
            m(x[:, t:t + 1], cache)
            assert cache.num_cmp == reference.num_cmp(t + 1, c.block_len, c.block_stride)
        k, v = cache.selection_kv()
        k_cmp, v_cmp = cache.compressed_kv()
        torch.testing.assert_close(k_cmp, m.phi_k(k, c.block_len, c.block_stride), atol=1e-12,
                                   rtol=0)
        torch.testing.assert_close(v_cmp, m.phi_v(v, c.block_len, c.block_stride), atol=1e-12,
                                   rtol=0)


def test_decode_from_empty_cache_directly():
    m, x = layer(), inputs(1)
    c = m.config
    with torch.no_grad():
        ref = m(x[:, :50])
        cache = m.new_cache(1)
        pos = torch.arange(50)
        q, k, v = m._qkv(x[:, :50], pos)
        cache.append(k, v, m.phi_k, m.phi_v)
        o = decode_attention(q, cache, *m.gates(x[:, :50]), scale=c.scale)
    torch.testing.assert_close(m.o_proj(o.flatten(-2)), ref, atol=1e-10, rtol=0)


def test_static_capacity_is_preallocated_and_raises_when_full():
    m, x = layer(), inputs(2)
    cache = m.new_cache(2, capacity=20)
    ptrs = [t.data_ptr() for t in (cache.k, cache.v, cache.k_cmp, cache.v_cmp)]
    with torch.no_grad():
        m(x[:, :15], cache)
        m(x[:, 15:20], cache)
        assert [t.data_ptr() for t in (cache.k, cache.v, cache.k_cmp, cache.v_cmp)] == ptrs
        with pytest.raises(RuntimeError, match="NSACache is full: capacity=20 tokens, 20 cached"):
            m(x[:, 20:21], cache)
        assert cache.length == 20
        cache.reset()
        ref = m(x[:, :20])
        out, _ = decode(m, x, cache, [7, 13])
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)


def test_cache_input_errors():
    m = layer()
    cache = m.new_cache(2)
    with pytest.raises(ValueError, match=r"k must have shape \[B, Tq, H, Dk\] = \(2, 1, 2, 8\)"):
        m(torch.randn(1, 1, 32, dtype=torch.float64), cache)
    with pytest.raises(ValueError, match="must be torch.float64"):
        m.float()(torch.randn(2, 1, 32), cache)
    with pytest.raises(ValueError, match="capacity must be a positive int"):
        NSACache(m.config, capacity=0)
