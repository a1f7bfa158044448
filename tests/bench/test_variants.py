import pytest

from specserve.bench.variants import VARIANTS, speculative_config
from specserve.config import SpecConfig


def test_every_variant_is_a_config_the_server_parses():
    for variant in (*VARIANTS, "k=3"):
        config = speculative_config(variant, k=5, quantization="int8", fused=None)
        if variant == "plain":
            assert config is None
            continue
        spec = SpecConfig.parse(config)
        assert spec.adaptive == variant.startswith("adaptive")
        assert spec.method == next((m for m in ("eagle3", "medusa") if m in variant), "draft_model")
        if spec.method == "draft_model":
            assert spec.quantization == "int8" and spec.fused is None
            assert spec.num_speculative_tokens == (3 if variant == "k=3" else 5)
        else:
            assert spec.quantization is None  # a draft's key only
            assert spec.num_speculative_tokens == (5 if spec.method == "eagle3" else None)  # Medusa: its heads


@pytest.mark.parametrize("variant", ["k=0", "k=x", "adaptive-k=3", "eagle", "Plain", ""])
def test_unknown_variants_are_named(variant):
    with pytest.raises(ValueError, match="unknown variant"):
        speculative_config(variant)
