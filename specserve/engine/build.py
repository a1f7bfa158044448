"""Build an engine from flags, and run one request through it with its figures.

Shared by `specserve generate` and the benchmark scripts, so both report the same
numbers in the same words.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

import torch

from specserve.catalogue import LoadedModel, load_model
from specserve.config import SpecConfig, prefill_chunk_size_for
from specserve.engine.engine import DEFAULT_MAX_NUM_SEQS, Engine
from specserve.errors import ConfigError
from specserve.model.decoder import Decoder
from specserve.model.device import CPU
from specserve.model.kv_cache import CachePool, KVCache, bytes_per_position
from specserve.model.prefix_cache import BLOCK, PrefixCache
from specserve.sampling import SamplingParams
from specserve.spec.adaptive import AdaptiveSpecLength
from specserve.spec.cost import prior_cost_ratio
from specserve.spec.draft_model import DraftModelProposer
from specserve.spec.eagle import EagleProposer
from specserve.spec.factory import make_proposer
from specserve.spec.heads.eagle import EagleHead
from specserve.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger("specserve")

GRAPH_MEMORY_SHARE = 0.9  # of the GPU's free memory that the cache pools may take
# Of the memory available once the models are loaded, what `kv_cache_space="auto"` lets
# the running sequences' keys and values take: the rest for activations, the prefix
# cache and the server.
KV_AUTO_SHARE = 0.5


def build_engine(
    model: str,
    spec: SpecConfig | None = None,
    dtype: torch.dtype = torch.float32,
    max_model_len: int | None = None,
    quantization: str = "none",
    batch_invariant: bool = False,
    compile: bool | None = None,
    device: torch.device = CPU,
    cuda_graphs: bool | None = None,
    prefix_cache_space: float | None = None,
    kv_cache_space: float | str | None = None,
    **engine_options: int | str,
) -> tuple[Engine, Tokenizer]:
    """The target (and the draft) loaded; engine_options: max_num_seqs, prefill_chunk_size
    (None or absent: the device's, `prefill_chunk_size_for`), scheduling_policy.
    batch_invariant applies to the target (a draft's numbers need not be exact), compile
    to both and to an unquantized EAGLE head (`Decoder.use_torch_compile`), device and cuda_graphs to all
    (`Decoder.use_cuda_graphs`: a pool of max_num_seqs caches of max_model_len).
    cuda_graphs: True asks for them (an error where they cannot run), False refuses them
    (`--enforce-eager`), None takes them on a CUDA GPU where the caches fit (vLLM's default).
    compile likewise: None compiles on a CUDA GPU with graphs, where inductor works.
    prefix_cache_space: GiB of keys and values kept for prefix caching
    (model/prefix_cache.py), the target's and a draft model's or EAGLE head's together; None: off.
    kv_cache_space: GiB that the running sequences' keys and values (target, draft and
    head together) may take where caches grow (not a CUDA graph pool, which is fixed),
    requests waiting or preempted beyond it (see Engine); "auto": see `kv_positions`;
    None: no bound."""
    if cuda_graphs and device.type != "cuda":
        raise ConfigError(f"--cuda-graphs needs a CUDA GPU (--device cuda); the models run on {device}")
    if compile is None and (device.type != "cuda" or cuda_graphs is False):
        compile = False
    target = load_model(model, dtype, quantization, batch_invariant, compile, device)
    if max_model_len is not None and not 0 < max_model_len <= target.config.max_position_embeddings:
        raise ConfigError(
            f"--max-model-len must be in [1, {target.config.max_position_embeddings}] "
            f"for {model!r}, got {max_model_len}"
        )
    chunk = engine_options.get("prefill_chunk_size") or prefill_chunk_size_for(device)
    engine_options["prefill_chunk_size"] = chunk
    proposer = None
    if spec is not None:
        proposer, spec = make_proposer(spec, target, dtype, chunk, quantization, compile)
    # The head's steps compiled as the target's, where its layers are PyTorch's: a
    # quantized head's run our C kernels, which compiling only breaks into pieces.
    if isinstance(proposer, EagleProposer) and target.decoder.compiled and quantization == "none":
        proposer.head.use_torch_compile(required=bool(compile))
    decoders = [target.decoder] + ([proposer.draft] if isinstance(proposer, DraftModelProposer) else [])
    if cuda_graphs is not False and device.type == "cuda":
        slots = engine_options.get("max_num_seqs", DEFAULT_MAX_NUM_SEQS)
        positions = max_model_len or target.config.max_position_embeddings
        head = [proposer.head] if isinstance(proposer, EagleProposer) else []
        use_cuda_graphs(decoders + head, slots, positions, asked=bool(cuda_graphs))
    prefix_cache = None
    if prefix_cache_space is not None:
        max_tokens = int(prefix_cache_space * 2**30) // kv_bytes_per_position(target.decoder, proposer)
        if max_tokens < BLOCK:
            raise ConfigError(
                f"--prefix-cache-space {prefix_cache_space} GiB holds {max_tokens} tokens of "
                f"{model!r}; give room for at least {BLOCK}"
            )
        prefix_cache = PrefixCache(max_tokens)
        if isinstance(proposer, (DraftModelProposer, EagleProposer)):
            proposer.prefix_cache = PrefixCache(max_tokens)
    kv_cache_positions = None
    if kv_cache_space is not None and target.decoder.static is None:
        longest = max_model_len or target.config.max_position_embeddings
        per_position = kv_bytes_per_position(target.decoder, proposer)
        slots = engine_options.get("max_num_seqs", DEFAULT_MAX_NUM_SEQS)
        kv_cache_positions = kv_positions(kv_cache_space, per_position, target.decoder.new_cache(), longest, slots)
    engine = engine_over(
        target.decoder,
        target.tokenizer.eos_token_ids,
        proposer,
        spec,
        max_model_len=max_model_len,
        prefix_cache=prefix_cache,
        kv_cache_positions=kv_cache_positions,
        **engine_options,
    )
    return engine, target.tokenizer


def engine_for_spec(target: LoadedModel, spec_json: str | None, quantization: str = "none") -> Engine:
    """An engine over a loaded target as `specserve serve` builds one for a
    `--speculative-config` (None: plain), its draft quantized as the target: what the
    benchmarks that keep one target for several modes run."""
    spec = SpecConfig.parse(spec_json)
    proposer = None
    if spec is not None:
        proposer, spec = make_proposer(spec, target, target.decoder.dtype, quantization=quantization)
    return engine_over(target.decoder, target.tokenizer.eos_token_ids, proposer, spec)


def engine_over(
    target: Decoder, eos_token_ids: list[int], proposer: object, spec: SpecConfig | None, **engine_options: Any
) -> Engine:
    """An engine over a loaded target and the proposer `make_proposer` made for spec
    (settled by it), as `spec` asks: its k, adaptive k and lookups first; no speculation
    where spec is None. engine_options: the rest of Engine's arguments."""
    if spec is None:
        return Engine(target, eos_token_ids=eos_token_ids, **engine_options)
    adaptive = None
    if spec.adaptive:
        adaptive = AdaptiveSpecLength(
            spec.max_speculative_tokens, prior_cost_ratio(proposer, target), spec.max_lookup_tokens
        )
    return Engine(
        target,
        eos_token_ids=eos_token_ids,
        proposer=proposer,
        num_speculative_tokens=spec.num_speculative_tokens,
        adaptive=adaptive,
        lookup_first=spec.prompt_lookup_first,
        lookup_answers=spec.lookup_answers,
        **engine_options,
    )


def kv_bytes_per_position(target: Decoder, proposer: object) -> int:
    """Bytes of keys and values a sequence's position takes: the target's, and a draft
    model's or an EAGLE head's alongside."""
    total = bytes_per_position(target.config, target.dtype)
    if isinstance(proposer, DraftModelProposer):
        total += bytes_per_position(proposer.draft.config, proposer.draft.dtype)
    elif isinstance(proposer, EagleProposer):
        total += bytes_per_position(proposer.head.config.layer, proposer.head.dtype)
    return total


MEMINFO = "/proc/meminfo"
# A container's memory limit and use (cgroup v2, then v1): MEMINFO shows the host's.
CGROUP_MEMORY_FILES = (
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
)


def available_memory() -> int | None:
    """Bytes the system could still give this process: Linux's MemAvailable, or less
    where the process's container has a limit closer; None where neither is known."""
    found = []
    try:
        with open(MEMINFO, encoding="ascii") as meminfo:
            found += [int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    for limit_file, usage_file in CGROUP_MEMORY_FILES:
        try:
            limit, usage = (Path(f).read_text().strip() for f in (limit_file, usage_file))
            if limit.isdigit() and int(limit) < 2**60:  # "max" or a huge number: no limit
                found.append(max(int(limit) - int(usage), 0))
                break
        except (OSError, ValueError):
            continue
    return min(found, default=None)


def kv_positions(space: float | str, per_position: int, fresh: KVCache, longest: int, slots: int) -> int | None:
    """The target positions of KV storage the running sequences may hold: `space` GiB at
    per_position bytes. "auto": KV_AUTO_SHARE of the memory available now; None (no bound)
    where that holds `slots` sequences of `longest` positions, or the memory is unknown;
    never less than one such sequence, which a request may need alone."""
    if space != "auto":
        return int(float(space) * 2**30) // per_position
    one = fresh.capacity_for(longest)  # a sequence's storage at its longest (caches double)
    available = available_memory()
    if available is None:
        return None
    positions = int(KV_AUTO_SHARE * available) // per_position
    if positions >= slots * one:
        return None
    if positions < one:
        log.warning(
            "the KV cache space holds one sequence of %d positions (%.1f GiB), more than half the memory "
            "available; lower --max-model-len if the server runs out of memory",
            longest,
            one * per_position / 2**30,
        )
    return max(positions, one)


def use_cuda_graphs(models: list[Decoder | EagleHead], slots: int, positions: int, asked: bool) -> None:
    """CUDA graphs for every decoder (and an EAGLE head's own steps); where their cache
    pools do not fit the GPU, an error if they were asked for, else a warning and eager steps.
    The captured steps of each model may hold an equal share of what the pools leave of
    GRAPH_MEMORY_SHARE of the free memory (graphs.CapturedSteps)."""
    needed = sum(
        CachePool.bytes_needed(m.config.layer if isinstance(m, EagleHead) else m.config, m.dtype, slots, positions)
        for m in models
    )
    free, _ = torch.cuda.mem_get_info(models[0].device)
    if needed > GRAPH_MEMORY_SHARE * free:
        message = (
            f"CUDA graphs preallocate the KV caches: {needed / 2**30:.1f} GiB for {slots} sequences of "
            f"{positions} tokens, where {free / 2**30:.1f} GiB of GPU memory are free"
        )
        if asked:
            raise ConfigError(f"{message}; lower --max-num-seqs or --max-model-len")
        log.warning("%s: running eagerly (lower --max-num-seqs or --max-model-len to use them)", message)
        return
    captured_bytes = max(int(GRAPH_MEMORY_SHARE * free) - needed, 0) // len(models)
    for model in models:
        model.use_cuda_graphs(slots, positions, captured_bytes)


def encode_prompt(
    tokenizer: Tokenizer, prompt: str | None = None, chat: str | None = None, suffix: str | None = None
) -> list[int]:
    """Token ids of raw text (with a suffix: the text before a gap to fill,
    `Tokenizer.encode_infill`), or of one user message wrapped in the chat template."""
    if chat is not None:
        if suffix is not None:
            raise ConfigError("--suffix fills the gap after a --prompt; a --chat message has none")
        return tokenizer.encode_chat([{"role": "user", "content": chat}])
    if not prompt:
        raise ConfigError("the prompt is empty: pass some text with --prompt or --chat")
    return tokenizer.encode(prompt) if suffix is None else tokenizer.encode_infill(prompt, suffix)


def run_one(
    engine: Engine,
    tokenizer: Tokenizer,
    prompt_ids: list[int],
    params: SamplingParams,
    on_text: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Generate for one prompt; stream text to on_text; return `generate --json`'s object."""
    seq = engine.add_request(prompt_ids, params)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    emitted = 0
    while not seq.finished:
        engine.step()
        if on_text is not None:
            on_text(detokenizer.add(seq.output_ids[emitted:]))
            emitted = seq.num_output_tokens
    if on_text is not None:
        on_text(detokenizer.flush())
    timings = seq.timings()
    decode_s = timings["e2e_s"] - timings["ttft_s"]
    return {
        "text": tokenizer.decode(seq.output_ids),
        "token_ids": seq.output_ids,
        "num_prompt_tokens": seq.num_prompt_tokens,
        "num_cached_tokens": seq.num_cached_tokens,  # of the prompt, found in the prefix cache
        "num_output_tokens": seq.num_output_tokens,
        "finish_reason": seq.finish_reason,
        **timings,
        "output_tokens_per_s": seq.num_output_tokens / timings["e2e_s"],
        # Tokens after the first, per second after the first: the decode rate alone.
        "decode_tokens_per_s": (seq.num_output_tokens - 1) / decode_s if decode_s > 0 else None,
        "spec": seq.spec.to_dict() if engine.proposer is not None else None,
        # Where a prediction was given: its drafted tokens the target accepted and rejected.
        "prediction": None
        if seq.prediction is None
        else {"accepted": seq.prediction.accepted, "rejected": seq.prediction.rejected},
    }
