"""The decode layer stack (one C++ call for a step's layers) against the model's modules, on the real
tiny model: the same hidden states to the last bit at every step, in float32 and bf16 (where
native), with a cache of the model's dtype and an FP8 cache, scattered blocks and uneven contexts,
decode steps and steps with one prompt chunk beside the decodes (a new prompt, a continued one); and
it steps aside wherever the modules would not make exactly its kernel calls."""

import random

import pytest
import torch

from chatfleet.engine.builtin_models.tiny import resolve_model
from chatfleet.engine.models import decode_stack, packed_gemv
from chatfleet.engine.models.dtype import native_bf16
from chatfleet.engine.models.loader import load_model
from chatfleet.engine.models.qwen3 import Qwen3ForCausalLM
from chatfleet.engine.outputs import ScheduledChunk, SchedulerOutput
from chatfleet.engine.request import SamplingParams
from chatfleet.engine.runner.torch_runner import TorchRunner

BLOCK = 16

DTYPES = ["float32", pytest.param("bfloat16", marks=pytest.mark.skipif(
    not native_bf16(torch.device("cpu")), reason="the CPU emulates bfloat16"))]


@pytest.fixture(scope="module", params=DTYPES)
def loaded(request):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = load_model(resolve_model("tiny"), dtype=request.param)
    if model.model.decode_stack() is None:
        pytest.skip("the decode stack does not build here (no AVX-512, no compiler, or kernels off)")
    yield model
    model.model.decode_stack_enabled = True
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def stack_on_again(request):
    """Every test starts with the stack switched on (a test switches it off to run the modules)."""
    yield
    if "loaded" in request.fixturenames:
        request.getfixturevalue("loaded").model.decode_stack_enabled = True


class Recorder:
    """Wraps the model's forward: every step's hidden states, and how many ran in the stack."""

    def __init__(self, model: Qwen3ForCausalLM, monkeypatch: pytest.MonkeyPatch) -> None:
        self.hidden: list[torch.Tensor] = []
        self.stack_steps = 0
        forward, run = Qwen3ForCausalLM.forward, decode_stack.DecodeStack.run

        def recording_forward(model_self, *args, **kwargs):
            out = forward(model_self, *args, **kwargs)
            self.hidden.append(out.clone())
            return out

        def counting_run(stack_self, *args, **kwargs):
            self.stack_steps += 1
            return run(stack_self, *args, **kwargs)

        monkeypatch.setattr(Qwen3ForCausalLM, "forward", recording_forward)
        monkeypatch.setattr(decode_stack.DecodeStack, "run", counting_run)


def decode_steps(loaded, enabled: bool, batch: int, kv: str = "auto", steps: int = 6, seed: int = 0,
                 mixed_prompt: bool = False, continued: bool = False, chunk: int = 5, prompts: int = 1) -> None:
    """Prompts of uneven lengths into scattered blocks, then ``steps`` greedy decode steps of the
    whole batch (with ``mixed_prompt``, each step also carries ``prompts`` prompt chunks of ``chunk``
    tokens: new requests' first chunks, or with ``continued`` the next chunk of one long prompt)."""
    loaded.model.decode_stack_enabled = enabled
    rng = random.Random(seed)
    vocab = loaded.config.vocab_size
    lens = [rng.randrange(1, 70) for _ in range(batch)]
    per_seq = -(-(max([*lens, 0]) + steps + 1 + chunk * steps) // BLOCK)
    blocks = list(range((batch + prompts) * per_seq))
    random.Random(seed + 1).shuffle(blocks)
    tables = [blocks[i * per_seq:(i + 1) * per_seq] for i in range(batch + prompts)]
    runner = TorchRunner(loaded, len(blocks), BLOCK, kv_cache_dtype=kv)
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    ids = [f"r{i}" for i in range(batch)]
    for i in range(batch):
        prompt = [rng.randrange(vocab) for _ in range(lens[i])]
        runner.execute(SchedulerOutput([ScheduledChunk(ids[i], prompt, 0, tables[i], True, params, 0)]))
    for s in range(steps):
        chunks = [ScheduledChunk(ids[i], [rng.randrange(vocab)], lens[i] + s, tables[i], True, params, s + 1)
                  for i in range(batch)]
        if mixed_prompt:
            for j in range(prompts):
                rid, start = (f"p{j}", chunk * s) if continued else (f"p{j}-{s}", 0)
                chunks.append(ScheduledChunk(rid, [rng.randrange(vocab) for _ in range(chunk)], start,
                                             tables[batch + j], not continued or s == steps - 1, params, 0))
        runner.execute(SchedulerOutput(chunks))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def prompt_steps_in_the_stack(batch: int, kv: str, seed: int = 0) -> int:
    """How many of decode_steps' prompt steps (one prompt each) the stack takes: a prompt of at most
    ``packed_gemv.MAX_ROWS`` tokens over a cache of the model's dtype, or of one token (a decode row
    to the runner) over any."""
    rng = random.Random(seed)
    lens = [rng.randrange(1, 70) for _ in range(batch)]
    return sum(n == 1 or (kv != "fp8" and n <= packed_gemv.MAX_ROWS) for n in lens)


def same_bits_both_ways(loaded, monkeypatch, **kwargs) -> Recorder:
    modules = Recorder(loaded.model, monkeypatch)
    decode_steps(loaded, False, **kwargs)
    assert modules.stack_steps == 0
    monkeypatch.undo()
    stacked = Recorder(loaded.model, monkeypatch)
    decode_steps(loaded, True, **kwargs)
    assert len(stacked.hidden) == len(modules.hidden)
    for ours, theirs in zip(stacked.hidden, modules.hidden, strict=True):
        assert torch.equal(bits(ours), bits(theirs))
    return stacked


@pytest.mark.parametrize("kv", ["auto", "fp8"])
@pytest.mark.parametrize("batch", [1, 5, packed_gemv.MAX_ROWS])
def test_stack_gives_the_modules_bits_at_every_step(loaded, monkeypatch, batch, kv):
    stacked = same_bits_both_ways(loaded, monkeypatch, batch=batch, kv=kv)
    assert len(stacked.hidden) == batch + 6
    # every decode step ran in the stack, and every prompt step of a prompt it takes
    assert stacked.stack_steps == 6 + prompt_steps_in_the_stack(batch, kv)


@pytest.mark.parametrize(("batch", "chunk", "continued"),
                         [(0, 7, False), (3, 5, False), (3, 9, True), (12, 20, True),
                          (8, packed_gemv.MAX_ROWS - 8, False), (1, 33, True)])
def test_a_prompt_chunk_beside_the_decodes_gets_the_modules_bits(loaded, monkeypatch, batch, chunk, continued):
    """A new prompt's chunk (keys from its own rows) or a long prompt's next chunk (keys from the
    cache: earlier chunks' and its own), beside 0-56 decodes."""
    stacked = same_bits_both_ways(loaded, monkeypatch, batch=batch, mixed_prompt=True, continued=continued,
                                  chunk=chunk)
    assert stacked.stack_steps == 6 + prompt_steps_in_the_stack(batch, "auto")


@pytest.mark.parametrize(("batch", "chunk", "prompts", "continued"),
                         [(0, 4, 2, False), (5, 6, 3, True), (9, 17, 3, False), (2, 20, 3, True)])
def test_several_prompt_chunks_beside_the_decodes_get_the_modules_bits(loaded, monkeypatch, batch, chunk, prompts,
                                                                        continued):
    """Several turns joining in one step: each chunk attends over its own sequence's keys."""
    stacked = same_bits_both_ways(loaded, monkeypatch, batch=batch, mixed_prompt=True, continued=continued,
                                  chunk=chunk, prompts=prompts)
    assert stacked.stack_steps == 6 + prompt_steps_in_the_stack(batch, "auto")


def test_steps_the_stack_does_not_take_run_the_modules(loaded, monkeypatch):
    rec = Recorder(loaded.model, monkeypatch)
    decode_steps(loaded, True, packed_gemv.MAX_ROWS + 1, steps=2)  # more rows than the packed kernel takes
    assert rec.stack_steps == prompt_steps_in_the_stack(packed_gemv.MAX_ROWS + 1, "auto")
    rec.stack_steps = 0
    decode_steps(loaded, True, 3, steps=2, mixed_prompt=True, chunk=packed_gemv.MAX_ROWS)  # a chunk too long
    decode_steps(loaded, True, 3, kv="fp8", steps=2, mixed_prompt=True)  # one over an FP8 cache
    assert rec.stack_steps == prompt_steps_in_the_stack(3, "auto") + prompt_steps_in_the_stack(3, "fp8")
    rec.stack_steps = 0
    decode_steps(loaded, False, 3, steps=2)  # switched off
    assert rec.stack_steps == 0
    layer = loaded.model.decoder_layers[0].self_attn
    layer.kv_observer = lambda k, v: None  # FP8 scale calibration watches the modules' k and v
    try:
        decode_steps(loaded, True, 3, steps=2)
    finally:
        layer.kv_observer = None
    assert rec.stack_steps == 0
    decode_steps(loaded, True, 3, steps=2)
    assert rec.stack_steps == 2 + prompt_steps_in_the_stack(3, "auto")


def test_greedy_tokens_match_the_modules_over_a_long_decode(loaded):
    def tokens(enabled: bool) -> list[list[int]]:
        loaded.model.decode_stack_enabled = enabled
        runner = TorchRunner(loaded, 64, BLOCK)
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        prompts = [[5, 17, 99, 3], [42] * 30, list(range(1, 50))]
        tables = [list(range(i * 20, (i + 1) * 20)) for i in range(3)]
        out: list[list[int]] = [[] for _ in prompts]
        for i, p in enumerate(prompts):
            sampled = runner.execute(SchedulerOutput([ScheduledChunk(f"g{i}", p, 0, tables[i], True, params, 0)]))
            out[i].append(sampled.sampled[f"g{i}"].token_id)
        for s in range(39):
            chunks = [ScheduledChunk(f"g{i}", [out[i][-1]], len(p) + s, tables[i], True, params, s + 1)
                      for i, p in enumerate(prompts)]
            sampled = runner.execute(SchedulerOutput(chunks))
            for i in range(3):
                out[i].append(sampled.sampled[f"g{i}"].token_id)
        return out

    assert tokens(True) == tokens(False)


def test_not_built_without_packed_linears():
    loaded = load_model(resolve_model("tiny"), dtype="float32", kernels="torch")
    assert loaded.model.kernels == "torch"
    assert loaded.model.decode_stack() is None


def test_operands_it_cannot_read_are_an_error_not_a_wrong_result(loaded):
    stack = loaded.model.decode_stack()
    assert stack is not None
    cfg = loaded.config
    runner = TorchRunner(loaded, 8, BLOCK)
    meta = runner._attention_metadata([ScheduledChunk("x", [1], 3, [0], True, SamplingParams(), 1)], [])
    assert stack.takes(1, meta, runner.kv_caches)
    emb = torch.zeros(1, cfg.hidden_size + 1, dtype=loaded.dtype)  # wrong width
    cos = torch.zeros(1, 1, cfg.head_dim, dtype=loaded.dtype)
    with pytest.raises(ValueError, match="operands"):
        stack.run(emb, cos, cos, meta)
