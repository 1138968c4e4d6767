"""Prompts with images on real vLLM (CPU build): a generated vision-language model
(``tools/make_vlm.py``: Idefics3 layout, 64 image tokens per image) on two workers started by ``kvroute up``, which
turns on their render endpoints (``--enable-scale-out``).

The gateway has each prompt with an image rendered by a worker (token ids, the image's
multimodal hash and its placeholder range) and keys its blocks as vLLM hashes them, the image's
hash mixed into the blocks its placeholders cover. A repeat goes to the worker holding it and is
credited exactly what vLLM reports cached; the same text with another image is credited only the
blocks before that image, again exactly what vLLM reports; the other worker is credited nothing."""
from __future__ import annotations

import base64
import io

import anthropic
import httpx
import pytest
from openai import OpenAI
from PIL import Image

from e2e.conftest import vllm_python, vllm_up
from conftest import ADMIN_TOKEN, metric, wait_until
from model_cache import ensure_model, ensure_vlm  # tools/, on the path from e2e.conftest

from .bodies import words

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
BLOCK = 32


@pytest.fixture(scope="module")
def vlm_cluster(tmp_path_factory):
    model = ensure_vlm(ensure_model("tiny", vllm_python()), 0, vllm_python())
    with vllm_up("up-vlm", model, "tiny-vlm", tmp_path_factory.mktemp("vlm-vllm"), "--workers", "2",
                 "--num-gpu-blocks-override", "128") as base:
        yield base


def image_url(seed: int) -> str:
    """A 64 x 48 PNG of a colour gradient picked by ``seed``, as a data URL."""
    img = Image.new("RGB", (64, 48))
    img.putdata([((x * 4 + seed * 37) % 256, (y * 5 + seed * 11) % 256, (seed * 71) % 256)
                 for y in range(48) for x in range(64)])
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def body(image_seed: int) -> dict:
    return {"model": "tiny-vlm", "max_tokens": 1, "temperature": 0, "messages": [
        {"role": "system", "content": "Vision check. " + words(120, 9100)},
        {"role": "user", "content": [{"type": "text", "text": "Describe this. " + words(20, 9101)},
                                     {"type": "image_url", "image_url": {"url": image_url(image_seed)}},
                                     {"type": "text", "text": words(30, 9102)}]}]}


def test_images_are_keyed_by_their_hash_where_their_placeholders_lie(vlm_cluster):
    base = vlm_cluster
    client = OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120)

    def explain(b: dict) -> dict:
        r = httpx.post(base + "/admin/explain", json=b, headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    first = client.chat.completions.with_raw_response.create(**body(1))
    holder = first.headers["x-kvroute-worker"]
    usage = first.parse().usage
    assert usage.prompt_tokens_details.cached_tokens == 0
    prompt = usage.prompt_tokens
    rendered = explain(body(1))
    assert rendered["prompt_tokens"] == prompt and rendered["tokenization_fallback"] is None
    hit = (prompt - 1) // BLOCK * BLOCK
    planned = wait_until(lambda: (p := explain(body(1)))["predicted_cached_tokens"] and p, 60, "the holder's KV events")
    assert (planned["chosen"], planned["predicted_cached_tokens"]) == (holder, hit)
    assert [sum(c["matched_blocks"].values()) for c in planned["candidates"] if c["worker"] != holder] == [0]
    again = client.chat.completions.with_raw_response.create(**body(1))
    assert again.headers["x-kvroute-worker"] == holder
    assert again.parse().usage.prompt_tokens_details.cached_tokens == hit

    # the same text around another image: only the blocks before the image's placeholders match
    other = explain(body(2))
    assert other["prompt_tokens"] == prompt  # the same number of image tokens
    share = other["predicted_cached_tokens"]
    assert other["chosen"] == holder and 0 < share < hit
    sent = client.chat.completions.with_raw_response.create(**body(2))
    assert sent.headers["x-kvroute-worker"] == holder
    assert sent.parse().usage.prompt_tokens_details.cached_tokens == share
    assert metric(base, "kvroute_tokenization_fallbacks_total", model="tiny-vlm", reason="multimodal") == 0


def test_an_image_in_a_messages_body_is_rendered_and_credited_as_vllm_caches_it(vlm_cluster):
    """The Anthropic Messages API (``/v1/messages/render``): a repeated body with an image block is
    credited exactly the ``cache_read_input_tokens`` vLLM reports."""
    base = vlm_cluster
    data = image_url(7).split(",", 1)[1]
    body = {"model": "tiny-vlm", "max_tokens": 1, "system": "Vision check. " + words(80, 9200),
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "look " + words(10, 9201)},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}]}]}

    def explain() -> dict:
        r = httpx.post(base + "/admin/explain?path=/v1/messages", json=body, headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    client = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=120)
    first = client.messages.with_raw_response.create(**body)
    holder, usage = first.headers["x-kvroute-worker"], first.parse().usage
    prompt = usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens
    assert usage.cache_read_input_tokens == 0 and explain()["prompt_tokens"] == prompt
    hit = (prompt - 1) // BLOCK * BLOCK
    planned = wait_until(lambda: (p := explain())["predicted_cached_tokens"] and p, 60, "the holder's KV events")
    assert (planned["chosen"], planned["predicted_cached_tokens"]) == (holder, hit)
    again = client.messages.with_raw_response.create(**body)
    assert again.headers["x-kvroute-worker"] == holder
    assert again.parse().usage.cache_read_input_tokens == hit


def test_a_body_the_renderer_refuses_falls_back_alone(vlm_cluster):
    """vLLM's render endpoint answers 400 for an image it cannot decode: that request is routed by
    load, and the next prompt with a good image is rendered at once (the endpoint is not rested)."""
    base = vlm_cluster
    broken = body(3)
    broken["messages"][1]["content"][1]["image_url"]["url"] = "data:image/png;base64,AAAA"
    r = httpx.post(base + "/admin/explain", json=broken, headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json()["tokenization_fallback"] == "render_refused"
    good = httpx.post(base + "/admin/explain", json=body(4), headers=AUTH, timeout=60).json()
    assert good["tokenization_fallback"] is None and good["prompt_tokens"] > 0
