"""Speculative variants by name, as the benchmark scripts that start servers take them:
each name's `--speculative-config`."""

from __future__ import annotations

from typing import Any

from specserve import catalogue

VARIANTS = ("plain", "adaptive", "eagle3", "adaptive-eagle3", "medusa", "adaptive-medusa")  # and k=N
DEFAULT_EAGLE_HEAD = f"{catalogue.DEFAULT_TARGET}-eagle3"
DEFAULT_MEDUSA_HEAD = f"{catalogue.DEFAULT_TARGET}-medusa"


def speculative_config(
    variant: str,
    k: int = 7,
    draft: str = catalogue.DEFAULT_DRAFT,
    eagle_head: str = DEFAULT_EAGLE_HEAD,
    medusa_head: str = DEFAULT_MEDUSA_HEAD,
    **draft_keys: Any,
) -> dict[str, Any] | None:
    """The config of a variant: None for "plain"; "k=N" the draft at a fixed N;
    "adaptive" the draft, adaptive from k; "eagle3" and "medusa" a head at k (a Medusa
    checkpoint: one per head), "adaptive-" either one adaptive. draft_keys (quantization,
    fused) go to the draft's variants. An unknown name raises ValueError."""
    if variant == "plain":
        return None
    adaptive = variant.startswith("adaptive")
    method = variant.removeprefix("adaptive").removeprefix("-")
    heads = {"eagle3": eagle_head, "medusa": medusa_head}
    if method in heads:
        config: dict[str, Any] = {"method": method, "model": heads[method]}
        if method == "eagle3":
            config["num_speculative_tokens"] = k  # Medusa: one per head
        return config | {"adaptive": adaptive}
    fixed_k = variant.removeprefix("k=")
    if variant != "adaptive" and not (variant.startswith("k=") and fixed_k.isdigit() and int(fixed_k) >= 1):
        raise ValueError(f"unknown variant {variant!r}: use plain, k=N or one of {', '.join(VARIANTS[1:])}")
    config = {"model": draft, "num_speculative_tokens": k if adaptive else int(fixed_k)}
    config.update({key: value for key, value in draft_keys.items() if value is not None})
    return config | {"adaptive": adaptive}
