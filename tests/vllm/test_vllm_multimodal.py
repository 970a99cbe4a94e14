"""Two images behind the same placeholder tokens never share KV (issue 20).

A real multimodal engine: LLaVA (``support.vllm_models`` kind ``llava``: a 2-layer CLIP
tower over 112 px images, 64 image tokens, and the ``gqa`` text model), dummy weights
replaced by seeded Kaiming-scale ones (``support.vllm_models.sensitive_weights``), a processor
written by the test. Prompt P: 300 text tokens, one ``<image>`` (vLLM expands it to 64
placeholder tokens, all the same id, at offset 300), 480 text tokens: 844 tokens, three
whole chunks of 256 and a partial one. Image X and image Y are seeded noise: the token
ids of (P, X) and (P, Y) are identical; only vLLM's multimodal hash, which vLLM folds into
the block hashes of the blocks the image touches, tells them apart. That hash covers the
model's path too (``model_config.model``), so the engines load the model from one
directory.

Engine A (connector) stores (P, X). A fresh engine B (another process) runs (P, Y): only
the chunk before the image (tokens 0-255, whose block hashes hold no image) may load, and
its output must equal the no-connector engine's for (P, Y). Loading X's KV for Y would be
silent: vLLM skips the encoder for loaded positions. Then B runs (P, X): it hits all three
chunks and equals A's own prefix-cache hit.

Outputs are compared to the last bit (tokens and top-5 logprobs), a hit run with a run
that hit as many tokens (see ``support.vllm_driver``).
"""

from __future__ import annotations

from typing import Any

import pytest

from support import vllm_driver as drv
from support.vllm_driver import EngineDriver, Lab, brief, expect, prompt, same, store, tokens
from support.vllm_models import multimodal_config

pytestmark = [pytest.mark.vllm, pytest.mark.xdist_group("vllm-multimodal")]

CONFIG = multimodal_config("llava")
IMAGE = CONFIG["image_token_index"]
IMAGE_TOKENS = (CONFIG["vision_config"]["image_size"] // CONFIG["vision_config"]["patch_size"]) ** 2
BEFORE, AFTER = 300, 480
LENGTH = BEFORE + IMAGE_TOKENS + AFTER  # after vLLM expands the <image> token
HIT = 3 * 256  # the whole chunks of P
PRE = BEFORE // 256 * 256  # the whole chunks before the image


@pytest.fixture
def engines(lab: Lab) -> tuple[EngineDriver, EngineDriver, EngineDriver, Any]:
    """A and B (connector), the no-connector reference, all LLaVA; and the real server."""
    server = lab.server("multimodal")
    # One model path for all: vLLM hashes each image together with the model's path.
    model_dir = str(lab.tmp / "llava")
    spec = drv.connected("llava", server, model_dir=model_dir)
    a = lab.engine("multimodal-a", spec)
    b = lab.engine("multimodal-b", spec)
    ref = lab.engine("multimodal-ref", {"model": "llava", "model_dir": model_dir})
    return a, b, ref, server


def reference(ref: EngineDriver, p: dict[str, Any], n: int) -> dict[str, Any]:
    """``p`` on the no-connector engine with exactly its first ``n`` tokens (no image) cached."""
    assert n <= BEFORE
    ref.reset_prefix_cache()
    if n:
        ref.run(prompt([*p["ids"][:n], *tokens(3, 998)]))
    out = ref.run(p)
    assert out["cached"] == n, f"the reference run hit {out['cached']} tokens, not {n}"
    return out


def test_images_behind_the_same_placeholder_tokens_never_share_kv(engines):
    a, b, ref, server = engines
    assert LENGTH > HIT + 1 and LENGTH < HIT + 128  # A's local hit is the three chunks
    ids = [*tokens(BEFORE, 21), IMAGE, *tokens(AFTER, 22)]
    x, y = prompt(ids, images=[1]), prompt(ids, images=[2])
    stored = store(a, server, x, chunks=3)  # A stores (P, X)
    a_hit = a.run(x)  # A's own prefix-cache hit: the reference for hits
    b.reset_prefix_cache()
    b_y = b.run(y)
    b_x = b.run(x)
    ref_y = reference(ref, y, min(b_y["cached"], PRE))
    ref_x = reference(ref, x, min(b_y["cached"], PRE))
    observed = {
        "prompt_tokens": LENGTH,
        "a_store": brief(stored),
        "a_hit": brief(a_hit),
        "b_image_y": brief(b_y),
        "b_image_x": brief(b_x),
        "ref_image_y": brief(ref_y),
        "ref_image_x": brief(ref_x),
    }
    expect(
        observed,
        images_change_the_output=not same(ref_x, ref_y),
        a_hit_is_local=a_hit["cached"] == HIT,
        other_image_no_hit_past_the_image=b_y["cached"] <= PRE and drv.connector_tokens(b_y) <= PRE,
        other_image_chunk_before_the_image_shared=b_y["cached"] == PRE and drv.connector_tokens(b_y) == PRE,
        other_image_equal_to_no_connector=same(b_y, ref_y),
        same_image_hits=b_x["cached"] == HIT and drv.connector_tokens(b_x) == HIT - b_y["cached"],
        same_image_equal_to_a_hit=same(b_x, a_hit),
    )
