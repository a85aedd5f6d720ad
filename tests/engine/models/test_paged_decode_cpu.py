"""The C++ paged decode kernel (models/paged_decode_cpu.py) against its torch reference and the
torch-op decode path, in float32 and bfloat16, over caches of the query's dtype and FP8 (e4m3,
every finite code), over scattered block tables; its FP8 gather against torch's conversion."""

import random

import pytest
import torch

from chatfleet.engine.models import paged_decode_cpu as pdc
from chatfleet.engine.models.cpu_kernel_build import build_library, compiler
from chatfleet.engine.models.decode_attention import build_decode_groups, decode_attention
from chatfleet.engine.models.kv_cache import dequantize_fp8, quantize_fp8
from chatfleet.engine.models.workspace import gather_blocks

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
@pytest.mark.parametrize("block_size", [16, 8, 1])  # under 16: runs of 16 keys start off the score rows' 16-multiples
def test_matches_the_reference(dtype, num_heads, num_kv_heads, head_dim, threads, block_size):
    lens = [1, 15, 16, 17, 500, 33, 160, 7, 9]
    q, key, value, _, tables, ctx = case(dtype, len(lens), num_heads, num_kv_heads, head_dim, lens,
                                         block_size=block_size)
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
    fp8 = key.to(torch.float8_e4m3fn)
    assert pdc.supports(torch.zeros(1, 8, 64), fp8) and pdc.supports(torch.zeros(1, 8, 64, dtype=torch.bfloat16), fp8)
    assert not pdc.supports(torch.zeros(1, 8, 64, dtype=torch.float16), fp8)


def _cpu_flags() -> set[str]:
    try:
        text = open("/proc/cpuinfo").read()  # noqa: SIM115 - one read
    except OSError:
        return set()
    return {f for line in text.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()}


amx_only = pytest.mark.skipif(not pdc.amx_in_use(), reason="no AMX here (or the OS refused its tile state)")


@pytest.fixture(params=[True, False], ids=["amx", "avx512"])
def amx(request):
    """Each test once with bf16 decode on AMX tiles (where in use here) and once on AVX-512."""
    if request.param and not pdc.amx_in_use():
        pytest.skip("no AMX here (or the OS refused its tile state)")
    pdc.use_amx(request.param)
    yield request.param
    pdc.use_amx(True)


@pytest.mark.skipif("amx_bf16" not in _cpu_flags(), reason="the CPU has no AMX")
def test_bf16_decode_takes_amx_tiles_where_the_cpu_has_them():
    assert pdc.amx_in_use()
    assert not pdc.use_amx(False) and not pdc.amx_in_use()
    assert pdc.use_amx(True)


@amx_only
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"),
                         [(8, 2, 64), (4, 4, 128), (16, 2, 64), (8, 1, 256), (8, 4, 64), (16, 8, 128)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_on_amx_and_on_avx512_both_match_the_reference(num_heads, num_kv_heads, head_dim, block_size, threads):
    lens = [1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 500, 1000]
    q, key, value, _, tables, ctx = case(torch.bfloat16, len(lens), num_heads, num_kv_heads, head_dim, lens,
                                         block_size=block_size, seed=5)
    ref = pdc.paged_decode_reference(q, key, value, tables, ctx, head_dim**-0.5)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    outs = {}
    try:
        for on in (True, False):
            assert pdc.use_amx(on) == on
            outs[on] = pdc.paged_decode(q, key, value, tables, ctx, head_dim**-0.5)
    finally:
        pdc.use_amx(True)
        torch.set_num_threads(before)
    for out in outs.values():
        torch.testing.assert_close(out.float(), ref.float(), atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])
    assert not torch.equal(outs[True], outs[False])  # the switch switches: AMX weighs V with bf16 numerators


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sequence_gets_the_same_bits_alone_and_in_a_batch(dtype, amx):
    lens = [700, 3, 129, 48]
    q, key, value, _, tables, ctx = case(dtype, len(lens), 8, 2, 64, lens, seed=7)
    together = pdc.paged_decode(q, key, value, tables, ctx, 0.125)
    for b in range(len(lens)):
        alone = pdc.paged_decode(q[b : b + 1], key, value, tables[b : b + 1], ctx[b : b + 1], 0.125)
        assert torch.equal(alone, together[b : b + 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_slots_past_a_context_are_never_weighed(dtype, block_size, amx):
    """Every cache slot outside the sequences' contexts (the rest of their last blocks, other blocks)
    holding NaN changes no bit of the output."""
    lens = [17, 40, 5, 64, 33]
    q, key, value, lists, tables, ctx = case(dtype, len(lens), 8, 2, 64, lens, block_size=block_size, seed=9)
    clean = pdc.paged_decode(q, key, value, tables, ctx, 0.125)
    used = torch.zeros(key.shape[1] * block_size, dtype=torch.bool)
    for blocks, n in zip(lists, lens, strict=True):
        for i in range(n):
            used[blocks[i // block_size] * block_size + i % block_size] = True
    stale = ~used.view(key.shape[1], block_size)
    key[:, stale], value[:, stale] = float("nan"), float("nan")
    assert torch.equal(pdc.paged_decode(q, key, value, tables, ctx, 0.125), clean)


FINITE_E4M3 = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # 0x7f/0xff: NaN
# what the KV cache holds (kv_cache.quantize_fp8): zero and normal codes, no subnormals
CACHE_E4M3 = torch.tensor([c for c in FINITE_E4M3.tolist() if c & 0x78 or not c & 0x7F], dtype=torch.uint8)


def fp8_codes(*shape, seed=0, codes=FINITE_E4M3):
    """Random e4m3 codes, every one of ``codes`` (by default every finite code: zero, subnormals,
    +-448), never NaN."""
    gen = torch.Generator().manual_seed(seed)
    pick = torch.randint(0, codes.numel(), shape, generator=gen)
    return codes[pick].view(torch.float8_e4m3fn)


def fp8_case(q_dtype, num_heads, num_kv_heads, head_dim, lens, seed=0, codes=FINITE_E4M3, block_size=16):
    q, key, _, tables, padded, ctx = case(q_dtype, len(lens), num_heads, num_kv_heads, head_dim, lens,
                                          block_size=block_size, seed=seed)
    key = fp8_codes(*key.shape, seed=seed + 1, codes=codes)
    value = fp8_codes(*key.shape, seed=seed + 2, codes=codes)
    return q, key, value, tables, padded, ctx


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(8, 2, 64), (4, 4, 128), (8, 1, 256), (4, 2, 48)])
@pytest.mark.parametrize("threads", [1, 2])
# block sizes under 16 start runs of 16 keys off the score rows' 16-multiples; bf16 over FP8 weighs V
# in pairs of keys (odd lengths; a block of 1 takes the unpaired loop)
@pytest.mark.parametrize("block_size", [16, 4, 1])
def test_an_fp8_cache_matches_the_reference_with_its_scales(q_dtype, num_heads, num_kv_heads, head_dim, threads,
                                                            block_size):
    lens = [1, 15, 16, 17, 500, 33, 160, 7, 5]
    q, key, value, _, tables, ctx = fp8_case(q_dtype, num_heads, num_kv_heads, head_dim, lens, block_size=block_size)
    k_scale, v_scale = 0.0123, 3.5  # codes reach +-448: scores of a few units, outputs of hundreds
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = pdc.paged_decode(q, key, value, tables, ctx, head_dim**-0.5, k_scale=k_scale, v_scale=v_scale)
    finally:
        torch.set_num_threads(before)
    ref = pdc.paged_decode_reference(q, key, value, tables, ctx, head_dim**-0.5, k_scale, v_scale)
    assert out.dtype == q_dtype and out.shape == q.shape
    scale = ref.abs().max().item()
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[q_dtype] * scale, rtol=TOL[q_dtype])
    # the scales are applied, not ignored: without them the output differs
    plain = pdc.paged_decode(q, key, value, tables, ctx, head_dim**-0.5)
    assert (plain.float() - out.float()).abs().max().item() > 10 * TOL[q_dtype] * scale


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_an_fp8_cache_matches_the_torch_op_decode_path(q_dtype):
    lens = sorted([3, 40, 41, 200, 513, 64])
    # the torch-op path multiplies placed codes directly: it takes the cache's codes (no subnormals)
    q, key, value, tables, padded, ctx = fp8_case(q_dtype, 8, 2, 64, lens, seed=3, codes=CACHE_E4M3)
    groups = build_decode_groups(lens, tables, 16, "cpu")
    torch_ops = decode_attention(q, key, value, groups, None, 0.125, 0.02, 0.5)
    out = pdc.paged_decode(q, key, value, padded, ctx, 0.125, k_scale=0.02, v_scale=0.5)
    scale = torch_ops.abs().max().item()
    torch.testing.assert_close(out.float(), torch_ops.float(), atol=4 * TOL[q_dtype] * scale, rtol=4 * TOL[q_dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 0.0123, 3.5])
def test_gather_fp8_is_torch_conversion_of_the_gathered_blocks(dtype, scale):
    """Every finite code, exactly: the bits torch's gather + dequantize give."""
    cache = fp8_codes(2, 40, 16, 64, seed=5)
    ids = torch.tensor([7, 0, 39, 3, 3, 12], dtype=torch.long)
    got = pdc.gather_fp8(cache, ids, scale, dtype)
    assert got is not None and got.shape == (2, 6, 16, 64) and got.dtype == dtype
    want = dequantize_fp8(gather_blocks(cache, ids, None, "k"), scale, dtype)
    assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
    if scale == 1.0:  # and torch's own element-wise conversion
        assert torch.equal(got.float(), cache[:, ids].float())


def test_gather_fp8_refuses_what_it_does_not_take_and_an_id_outside_the_cache():
    cache = fp8_codes(2, 4, 16, 64)
    assert pdc.gather_fp8(cache.float(), torch.tensor([0]), 1.0, torch.float32) is None  # not FP8
    assert pdc.gather_fp8(cache, torch.tensor([0], dtype=torch.int32), 1.0, torch.float32) is None
    assert pdc.gather_fp8(cache, torch.tensor([0]), 1.0, torch.float16) is None
    with pytest.raises(IndexError):
        pdc.gather_fp8(cache, torch.tensor([0, 4]), 1.0, torch.float32)


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


def awkward_values(n, gen):
    """Normal draws at many magnitudes, plus the values quantization treats specially: zeros,
    the snapping thresholds 2^-7 and 2^-6 and their neighbours, ties between e4m3 codes, 448 and
    beyond it (clamped)."""
    base = torch.randn(n, generator=gen) * torch.pow(2.0, torch.randint(-12, 10, (n,), generator=gen).float())
    f32 = torch.finfo(torch.float32)
    special = torch.tensor([0.0, -0.0, 2.0**-7, -(2.0**-7), 2.0**-7 * (1 - f32.eps), 2.0**-6, 2.0**-6 * (1 - f32.eps),
                            1.0625, 1.1875, -1.0625, 240.0 + 8.0, 448.0, 460.0, 464.0, 1e6, -1e6, 3e-9])
    return torch.cat((special, base))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.0123, 3.5), (1 / 3, 7e-4)])
def test_store_kv_fp8_writes_the_codes_quantize_fp8_writes(dtype, scales):
    gen = torch.Generator().manual_seed(6)
    heads, num_blocks, block_size, head_dim, tokens = 2, 9, 16, 64, 37
    fill = fp8_codes(heads, num_blocks, block_size, head_dim, seed=7)
    key, value = fill.clone(), fill.clone()
    width = (8 + 2 * heads) * head_dim
    raw = awkward_values(tokens * width, gen)[: tokens * width]
    qkv = raw[torch.randperm(raw.numel(), generator=gen)].view(tokens, width).to(dtype)  # a fused projection
    k = qkv[:, 8 * head_dim : (8 + heads) * head_dim].view(tokens, heads, head_dim)  # strided rows
    v = qkv[:, (8 + heads) * head_dim :].view(tokens, heads, head_dim) * scales[1]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    want_k, want_v = key.view(torch.uint8).clone(), value.view(torch.uint8).clone()
    want_k.view(heads, -1, head_dim).index_copy_(1, slots, quantize_fp8(k, scales[0]).view(torch.uint8).transpose(0, 1))
    want_v.view(heads, -1, head_dim).index_copy_(1, slots, quantize_fp8(v, scales[1]).view(torch.uint8).transpose(0, 1))
    assert pdc.store_kv_fp8(key, value, slots, k, v, *scales)
    assert torch.equal(key.view(torch.uint8), want_k) and torch.equal(value.view(torch.uint8), want_v)


def test_store_kv_fp8_refuses_what_it_does_not_take_and_a_slot_outside_the_cache():
    key = fp8_codes(2, 4, 16, 64)
    k = torch.ones(3, 2, 64)
    assert not pdc.store_kv_fp8(key.float(), key.float(), torch.tensor([0, 1, 2]), k, k, 1.0, 1.0)  # not FP8
    assert not pdc.store_kv_fp8(key, key.clone(), torch.tensor([0, 1, 2]), k.half(), k.half(), 1.0, 1.0)
    assert not pdc.store_kv_fp8(key, key.clone(), torch.tensor([0, 1, 2]), k.to(torch.bfloat16), k, 1.0, 1.0)
    before = key.clone()
    with pytest.raises(IndexError):
        pdc.store_kv_fp8(key, key.clone(), torch.tensor([0, 64, 2]), k, k, 1.0, 1.0)
    assert torch.equal(key.view(torch.uint8), before.view(torch.uint8))


def _cpu_vendor() -> str:
    try:
        text = open("/proc/cpuinfo").read()  # noqa: SIM115 - one read
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("vendor_id")), "")


@pytest.mark.skipif(_cpu_vendor() not in ("GenuineIntel", "AuthenticAMD"), reason="neither Intel nor AMD")
def test_blocks_in_runs_are_prefetched_on_intel_and_left_to_the_hardware_on_amd():
    assert pdc.prefetch_runs() == (_cpu_vendor() == "GenuineIntel")


@pytest.mark.parametrize("cache", ["float32", "bfloat16", "fp8"])
def test_prefetching_blocks_in_runs_or_not_gives_the_same_bits(cache):
    """The switch changes which cache lines are requested early, never a result: over tables whose
    blocks lie in runs (a prompt's) and then scattered (a decode's), on the AVX-512 paths."""
    dtype = torch.float32 if cache == "float32" else torch.bfloat16
    lens = [700, 3, 129, 48, 260]
    widths = [-(-n // 16) for n in lens]
    num_blocks = sum(widths) + 8
    gen = torch.Generator().manual_seed(11)
    if cache == "fp8":
        key = fp8_codes(2, num_blocks, 16, 64, seed=12, codes=CACHE_E4M3)
        value = fp8_codes(2, num_blocks, 16, 64, seed=13, codes=CACHE_E4M3)
    else:
        key = torch.randn(2, num_blocks, 16, 64, generator=gen).to(dtype)
        value = torch.randn(2, num_blocks, 16, 64, generator=gen).to(dtype)
    q = torch.randn(len(lens), 8, 64, generator=gen).to(dtype)
    rest = list(range(sum(w // 2 for w in widths), num_blocks))
    random.Random(11).shuffle(rest)
    tables, at = [], 0
    for w in widths:  # the first half of each sequence's blocks in order, the rest drawn at random
        tables.append(list(range(at, at + w // 2)) + [rest.pop() for _ in range(w - w // 2)])
        at += w // 2
    width = max(widths)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
    ctx = torch.tensor(lens, dtype=torch.long)
    scales = {"k_scale": 0.5, "v_scale": 0.25} if cache == "fp8" else {}
    default, amx = pdc.prefetch_runs(), pdc.amx_in_use()
    outs = {}
    try:
        pdc.use_amx(False)  # bf16 over a bf16 cache takes the AVX-512 path too
        for on in (True, False):
            assert pdc.prefetch_runs(on) == on
            outs[on] = pdc.paged_decode(q, key, value, padded, ctx, 0.125, **scales)
    finally:
        pdc.prefetch_runs(default)
        pdc.use_amx(amx)
    assert torch.equal(outs[True], outs[False])
    ref = pdc.paged_decode_reference(q, key, value, padded, ctx, 0.125, **scales)
    torch.testing.assert_close(outs[True].float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
