"""`specserve serve` with an EAGLE-3 head (random weights, made for smollm2-135m): a real
server on loopback answers with the target's own text, with prefix caching on."""

from __future__ import annotations

import json

import openai
import torch

from specserve.bench.local_server import ServerProcess

MODEL = "smollm2-135m"
STORY = "Once upon a time, in a small village by the sea, there lived an old fisherman and his cat. Every day"
PROMPTS = [STORY, "1, 2, 3, 4, 5,", STORY]  # the last one's prefix from the prefix cache: the head reads after it


def test_an_eagle3_server_answers_with_the_targets_text(prepared_cache, tmp_path):
    from specserve.engine.build import build_engine, run_one
    from specserve.sampling import SamplingParams
    from specserve.spec.heads.checkpoint import save_head
    from specserve.spec.heads.eagle import EagleConfig, EagleHead

    engine, tokenizer = build_engine(MODEL)
    torch.manual_seed(0)
    save_head(EagleHead(EagleConfig.for_target(engine.target.config, 3, draft_vocab_size=4096)), tmp_path / "head")
    spec = json.dumps(
        {"method": "eagle3", "model": str(tmp_path / "head"), "num_speculative_tokens": 3, "adaptive": False}
    )
    server = ServerProcess(
        MODEL,
        "--speculative-config",
        spec,
        "--max-model-len",
        "512",
        "--enable-prefix-caching",
        "--prefix-cache-space",
        "0.1",
    )
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        for prompt in PROMPTS:
            answer = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=24)
            expected = run_one(
                engine, tokenizer, tokenizer.encode(prompt), SamplingParams(max_tokens=24, temperature=0)
            )
            assert answer.choices[0].text == expected["text"]
            assert answer.model_extra["spec_decode"]["num_draft_tokens"] > 0
        assert answer.usage.prompt_tokens_details.cached_tokens > 0
        assert "an EAGLE-3 head drafts" in server.log()
    finally:
        server.stop()
