"""CUDA graphs for decode: which batch sizes are captured and how a batch is padded (the graphs
themselves are checked on a GPU: tests/engine/test_cuda_equivalence.py)."""

import pytest
import torch

from chatfleet.engine.runner.decode_graphs import DecodeGraphs, capture_sizes, padded_size


def test_capture_sizes_cover_the_largest_batch():
    assert capture_sizes(1) == (1,)
    assert capture_sizes(3) == (1, 2, 4)
    assert capture_sizes(8) == (1, 2, 4, 8)
    assert capture_sizes(9) == (1, 2, 4, 8, 16)
    assert capture_sizes(256)[-3:] == (240, 248, 256)
    assert capture_sizes(10_000) == capture_sizes(512)  # capped
    sizes = capture_sizes(100)
    assert list(sizes) == sorted(set(sizes)) and sizes[-1] >= 100
    with pytest.raises(ValueError):
        capture_sizes(0)


@pytest.mark.parametrize("n", range(1, 70))
def test_a_batch_pads_to_the_smallest_captured_size_that_holds_it(n):
    sizes = capture_sizes(64)
    got = padded_size(n, sizes)
    if n > 64:
        assert got is None
    else:
        assert got >= n and got in sizes and all(s < n for s in sizes if s < got)
        assert got - n < max(8, n)  # never more than one step of padding


def test_graphs_stay_off_on_the_cpu():
    graphs = DecodeGraphs(lambda *a: torch.zeros(1), [], 16, 4, capture_sizes(8), torch.device("cpu"))
    assert not graphs.enabled
    assert graphs.run([1], [0], [1], [[0]]) is None and graphs.replays == 0


def test_a_runner_on_the_cpu_has_no_graphs_and_the_kernels_path_when_asked():
    from chatfleet.engine.builtin_models.tiny import resolve_model
    from chatfleet.engine.models.loader import load_model
    from chatfleet.engine.runner.torch_runner import TorchRunner

    loaded = load_model(resolve_model("tiny"), dtype="float32")
    assert TorchRunner(loaded, 8, 16).graphs is None
    runner = TorchRunner(loaded, 8, 16, attention="kernels")
    assert runner.attention == "kernels" and runner.graphs is None
    with pytest.raises(ValueError):
        TorchRunner(loaded, 8, 16, attention="fast")


def test_capture_all_and_reset_are_no_ops_without_graphs():
    graphs = DecodeGraphs(lambda *a: torch.zeros(1), [], 16, 4, capture_sizes(8), torch.device("cpu"))
    assert graphs.capture_all() == () and graphs.captured == ()
    graphs.reset()
    assert graphs.captured == ()
