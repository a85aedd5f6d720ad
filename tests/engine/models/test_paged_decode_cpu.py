"""The C++ paged decode kernel (models/paged_decode_cpu.py) against its torch reference and the
torch-op decode path, in float32 and bfloat16, over scattered block tables."""

import random

import pytest
import torch

from chatfleet.engine.models import paged_decode_cpu as pdc
from chatfleet.engine.models.cpu_kernel_build import build_library, compiler
from chatfleet.engine.models.decode_attention import build_decode_groups, decode_attention

pytestmark = pytest.mark.skipif(not pdc.available(), reason="no C++ compiler: the kernel cannot be built here")

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def case(dtype, batch, num_heads, num_kv_heads, head_dim, lens, block_size=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    widths = [-(-n // block_size) for n in lens]
    num_blocks = sum(widths) + 3
    key = torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=gen).to(dtype)
    value = torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=gen).to(dtype)
    q = torch.randn(batch, num_heads, head_dim, generator=gen).to(dtype)
    blocks = list(range(num_blocks))
    random.Random(seed).shuffle(blocks)
    tables, at = [], 0
    for w in widths:
        tables.append(blocks[at : at + w])
        at += w
    width = max(widths) + 2  # wider than needed: entries past a sequence's context are never read
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
    return q, key, value, tables, padded, torch.tensor(lens, dtype=torch.long)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"),
                         [(8, 2, 64), (4, 4, 128), (16, 2, 64), (8, 1, 256), (4, 2, 48)])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_the_reference(dtype, num_heads, num_kv_heads, head_dim, threads):
    lens = [1, 15, 16, 17, 500, 33, 160, 7]
    q, key, value, _, tables, ctx = case(dtype, len(lens), num_heads, num_kv_heads, head_dim, lens)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = pdc.paged_decode(q, key, value, tables, ctx, head_dim**-0.5)
    finally:
        torch.set_num_threads(before)
    ref = pdc.paged_decode_reference(q, key, value, tables, ctx, head_dim**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_torch_op_decode_path(dtype):
    lens = sorted([3, 40, 41, 200, 513, 64])
    q, key, value, tables, padded, ctx = case(dtype, len(lens), 8, 2, 64, lens, seed=3)
    groups = build_decode_groups(lens, tables, 16, "cpu")
    torch_ops = decode_attention(q, key, value, groups, None, 0.125)
    out = pdc.paged_decode(q, key, value, padded, ctx, 0.125)
    torch.testing.assert_close(out.float(), torch_ops.float(), atol=4 * TOL[dtype], rtol=4 * TOL[dtype])


def test_a_non_contiguous_query_is_read_as_its_values():
    q, key, value, _, tables, ctx = case(torch.float32, 3, 8, 2, 64, [5, 20, 70])
    wide = torch.cat((q, torch.randn(3, 2, 64)), dim=1)[:, :8]  # q heads of a [T, Hq + Hkv, D] view
    assert not wide.is_contiguous()
    torch.testing.assert_close(pdc.paged_decode(wide, key, value, tables, ctx, 0.125),
                               pdc.paged_decode_reference(q, key, value, tables, ctx, 0.125), atol=2e-5, rtol=2e-5)


def test_supports_only_what_it_implements():
    key = torch.zeros(2, 4, 16, 64)
    assert pdc.supports(torch.zeros(1, 8, 64), key)
    assert not pdc.supports(torch.zeros(1, 8, 64, dtype=torch.float16), key.half())  # dtype
    assert not pdc.supports(torch.zeros(1, 8, 64, dtype=torch.bfloat16), key)  # cache of another dtype
    assert pdc.supports(torch.zeros(1, 8, 48), torch.zeros(2, 4, 16, 48))  # any head dim up to 512
    assert not pdc.supports(torch.zeros(1, 8, 576), torch.zeros(2, 4, 16, 576))
    assert not pdc.supports(torch.zeros(1, 32, 64), key)  # 16 query heads per kv head


def test_the_build_is_cached_by_source_compiler_and_cpu():
    cxx = compiler()
    assert cxx is not None
    first = build_library(cxx, pdc.SOURCE, pdc.FLAGS, pdc.LINK_FLAGS)
    assert first.exists() and build_library(cxx, pdc.SOURCE, pdc.FLAGS, pdc.LINK_FLAGS) == first


def test_loading_the_kernel_leaves_subnormals_alone():
    """Linked without -ffast-math: no crtfastmath.o setting flush-to-zero for the whole process."""
    assert pdc.available()
    tiny = 5e-324  # the smallest subnormal double
    assert tiny * 1.0 > 0.0
    assert torch.tensor([1e-40], dtype=torch.float32).mul(1.0).item() > 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_what_index_copy_writes(dtype):
    gen = torch.Generator().manual_seed(4)
    heads, num_blocks, block_size, head_dim, tokens = 2, 9, 16, 64, 37
    key = torch.randn(heads, num_blocks, block_size, head_dim, generator=gen).to(dtype)
    value = torch.randn(heads, num_blocks, block_size, head_dim, generator=gen).to(dtype)
    qkv = torch.randn(tokens, (8 + 2 * heads) * head_dim, generator=gen).to(dtype)  # a fused projection
    k = qkv[:, 8 * head_dim : (8 + heads) * head_dim].view(tokens, heads, head_dim)  # strided rows
    v = qkv[:, (8 + heads) * head_dim :].view(tokens, heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    want_k, want_v = key.clone(), value.clone()
    want_k.view(heads, -1, head_dim).index_copy_(1, slots, k.transpose(0, 1))
    want_v.view(heads, -1, head_dim).index_copy_(1, slots, v.transpose(0, 1))
    assert pdc.store_kv(key, value, slots, k, v)
    assert torch.equal(key, want_k) and torch.equal(value, want_v)


def test_store_kv_refuses_what_it_does_not_take_and_a_slot_outside_the_cache():
    key = torch.zeros(2, 4, 16, 64)
    k = torch.ones(3, 2, 64)
    assert not pdc.store_kv(key, key.clone(), torch.tensor([0, 1, 2]), k.to(torch.bfloat16), k)  # dtypes differ
    assert not pdc.store_kv(key, key.clone(), torch.tensor([0, 1, 2], dtype=torch.int32), k, k)
    assert not pdc.store_kv(key, key.clone(), torch.tensor([0, 1, 2]), k.transpose(1, 2).contiguous()
                            .transpose(1, 2), k)  # head dim not contiguous
    before = key.clone()
    with pytest.raises(IndexError):
        pdc.store_kv(key, key.clone(), torch.tensor([0, 64, 2]), k, k)
    assert torch.equal(key, before)
