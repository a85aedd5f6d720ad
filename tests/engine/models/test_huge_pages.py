"""One zeroed buffer cut into many tensors (the KV caches), on 2 MiB huge pages where the kernel
allows: the pieces are zero, aligned, disjoint and independent; on Linux with THP in ``madvise``
or ``always`` mode the buffer really is backed by huge pages (``/proc/self/smaps``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from chatfleet.engine.models import huge_pages as m
from chatfleet.engine.models.kv_cache import KVCache


def test_pieces_are_zero_aligned_disjoint_and_of_the_sizes_asked():
    sizes = [3 * 1024 * 1024 + 5, 0, 100, 4 * 1024 * 1024]
    pieces = m.zeroed_pieces(sizes)
    assert [p.numel() for p in pieces] == sizes
    spans = sorted((p.data_ptr(), p.data_ptr() + p.numel()) for p in pieces if p.numel())
    assert all(a_end <= b for (_, a_end), (b, _) in zip(spans, spans[1:], strict=False))
    for i, p in enumerate(pieces):
        assert p.data_ptr() % m.ALIGN == 0
        assert not p.any()
        p.fill_(i + 1)
    for i, p in enumerate(pieces):  # writing one never touched another
        assert (p == i + 1).all()


def test_negative_sizes_are_refused():
    with pytest.raises(ValueError):
        m.zeroed_pieces([5, -1])


def test_thp_mode_reads_the_bracketed_choice(tmp_path: Path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert m.thp_mode(f) == "madvise"
    f.write_text("[never]\n")
    assert m.thp_mode(f) == "never"
    assert m.thp_mode(tmp_path / "missing") == ""


@pytest.mark.skipif(m.thp_mode() not in ("always", "madvise"), reason="no transparent huge pages here")
def test_a_large_buffer_gets_huge_pages():
    (piece,) = m.zeroed_pieces([16 * m.HUGE_PAGE])
    got = m.huge_page_bytes(piece)
    if got == 0:
        pytest.skip("the kernel gave no huge pages (memory fragmented, or THP limited in this container)")
    assert got >= 8 * m.HUGE_PAGE


def test_caches_allocated_together_are_independent_views_of_their_shapes():
    shapes = [(10, 16, 2, 64), (7, 16, 1, 48)]
    caches = KVCache.allocate_many(shapes, torch.bfloat16, "cpu", [(1.0, 1.0), (0.5, 2.0)])
    assert [tuple(c.key.shape) for c in caches] == [(2, 10, 16, 64), (1, 7, 16, 48)]
    assert caches[1].k_scale == 0.5 and caches[1].v_scale == 2.0
    for c in caches:
        assert c.key.dtype == torch.bfloat16 and c.key.is_contiguous() and not c.key.any() and not c.value.any()
    caches[0].value.fill_(3.0)
    assert not caches[0].key.any() and not caches[1].key.any() and not caches[1].value.any()
    with pytest.raises(ValueError):
        KVCache.allocate_many(shapes, torch.bfloat16, "cpu", [(1.0, 1.0)])


@pytest.mark.skipif(m.thp_mode() != "madvise", reason="THP is not in madvise mode here")
def test_the_switch_keeps_small_pages(monkeypatch):
    monkeypatch.setenv("CHATFLEET_NO_HUGE_PAGES", "1")
    (piece,) = m.zeroed_pieces([16 * m.HUGE_PAGE])
    assert m.huge_page_bytes(piece) == 0
