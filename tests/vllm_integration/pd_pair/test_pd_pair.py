"""A real prefill/decode pair of ``vllm serve`` CPU instances (``conftest.py``) generates,
greedily, token for token what one plain instance generates, and D computes none of the
prompt by vLLM's count (``prompt_tokens_by_source``): every prompt token's KV reaches it from
P over Mooncake (D re-runs the last prompt token only, to sample from it).

Each request goes as vLLM's Mooncake toy proxy sends it
(``tests/v1/kv_connector/mooncake_integration/toy_proxy_server.py``): to P with
``max_tokens=1`` and ``do_remote_decode``, then to D with ``do_remote_prefill``, P's
bootstrap address, the engine id P registered there and the same ``transfer_id``. P's
reply carries no ``kv_transfer_params`` under vLLM 0.32's MooncakeConnector (the proxy
makes D's), and P holds the prompt's blocks until D has pulled them.

The prompts (token ids and text, 5 to 230 tokens: one to eight blocks of 32) go one at a
time and all at once. Nothing here is timed.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

pytestmark = pytest.mark.slow

MAX_TOKENS = 16
REQUEST_TIMEOUT_S = 120
VOCAB_SIZE = 512  # the tiny Llama's (bench/vllm_cpu/engine_run.py); ids 0-2 are special
TOKEN_PROMPT_LENGTHS = (5, 31, 32, 33, 96, 150, 230)
TEXT_PROMPT_LENGTHS = (40, 130)
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")

# The pairs these tests run, by ``conftest.PAIRS`` name: "plain", "kvdefrag-on-prefill",
# "kvdefrag-on-decode", "kvdefrag-on-both".
PAIR_NAMES = ["plain", "kvdefrag-on-prefill", "kvdefrag-on-decode", "kvdefrag-on-both"]
EACH_PAIR = pytest.mark.parametrize("pd_pair", PAIR_NAMES, indirect=True)


def _prompts() -> list[list[int] | str]:
    """Token-id prompts, then text prompts (the tokenizer's words are ``w<id>``)."""
    rng = random.Random(3)
    prompts: list[list[int] | str] = [
        [rng.randrange(3, VOCAB_SIZE) for _ in range(length)] for length in TOKEN_PROMPT_LENGTHS
    ]
    for length in TEXT_PROMPT_LENGTHS:
        prompts.append(" ".join(f"w{rng.randrange(3, VOCAB_SIZE)}" for _ in range(length)))
    return prompts


PROMPTS = _prompts()


@dataclasses.dataclass(frozen=True)
class Completion:
    """What one ``/v1/completions`` request returned."""

    token_ids: tuple[int, ...]
    text: str
    num_prompt_tokens: int
    num_cached_tokens: int | None

    @classmethod
    def from_response(cls, response: dict[str, Any]) -> Completion:
        choice = response["choices"][0]
        details = response["usage"].get("prompt_tokens_details") or {}
        return cls(
            token_ids=tuple(choice["token_ids"]),
            text=choice["text"],
            num_prompt_tokens=response["usage"]["prompt_tokens"],
            num_cached_tokens=details.get("cached_tokens"),
        )


def complete(
    url: str, prompt: list[int] | str, max_tokens: int, kv_transfer_params: dict[str, Any] | None
) -> Completion:
    """One greedy completion from the instance at ``url``."""
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
        return Completion.from_response(json.load(response))


def complete_through_pair(pair: Any, prompt: list[int] | str) -> tuple[Completion, Completion]:
    """The proxy's two calls: P prefills (one token), D pulls P's blocks and decodes.
    Returns (P's completion, D's)."""
    transfer_id = f"xfer-{uuid.uuid4()}"
    prefilled = complete(
        pair.prefill.url,
        prompt,
        1,
        {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id},
    )
    decoded = complete(
        pair.decode.url,
        prompt,
        MAX_TOKENS,
        {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "remote_bootstrap_addr": pair.bootstrap_url,
            "remote_engine_id": pair.prefill_engine_id,
            "transfer_id": transfer_id,
        },
    )
    return prefilled, decoded


def prompt_tokens_by_source(instance: Any) -> dict[str, float]:
    """vLLM's count of prompt tokens by where their KV came from (its ``/metrics``)."""
    samples = instance.metric("vllm:prompt_tokens_by_source_total")
    by_source = dict.fromkeys(SOURCES, 0.0)
    for labels, value in samples.items():
        match = re.search(r'source="([^"]+)"', labels)
        assert match is not None, labels
        by_source[match.group(1)] = by_source.get(match.group(1), 0.0) + value
    return by_source


def _difference(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {source: after[source] - before.get(source, 0.0) for source in after}


@pytest.fixture(scope="module")
def expected(single_instance: Any) -> list[Completion]:
    """What one plain instance generates for each prompt."""
    return [complete(single_instance.url, prompt, MAX_TOKENS, None) for prompt in PROMPTS]


def _assert_pair_generated_what_one_instance_did(
    pair: Any,
    run: list[tuple[Completion, Completion]],
    expected: list[Completion],
    prefill_before: dict[str, float],
    decode_before: dict[str, float],
) -> None:
    num_prompt_tokens = [completion.num_prompt_tokens for completion in expected]
    assert [decoded.num_prompt_tokens for _, decoded in run] == num_prompt_tokens
    assert [decoded.token_ids for _, decoded in run] == [c.token_ids for c in expected]
    assert [decoded.text for _, decoded in run] == [c.text for c in expected]
    # P sampled the same first token D did.
    assert [prefilled.token_ids for prefilled, _ in run] == [c.token_ids[:1] for c in expected]
    # P computed every prompt token; D none: every one came from P.
    total = float(sum(num_prompt_tokens))
    assert _difference(prompt_tokens_by_source(pair.prefill), prefill_before) == {
        "local_compute": total,
        "local_cache_hit": 0.0,
        "external_kv_transfer": 0.0,
    }
    assert _difference(prompt_tokens_by_source(pair.decode), decode_before) == {
        "local_compute": 0.0,
        "local_cache_hit": 0.0,
        "external_kv_transfer": total,
    }
    assert [decoded.num_cached_tokens for _, decoded in run] == num_prompt_tokens


@EACH_PAIR
def test_each_prompt_alone_through_the_pair_generates_what_one_instance_generates(
    pd_pair: Any, expected: list[Completion]
) -> None:
    prefill_before = prompt_tokens_by_source(pd_pair.prefill)
    decode_before = prompt_tokens_by_source(pd_pair.decode)
    run = [complete_through_pair(pd_pair, prompt) for prompt in PROMPTS]
    _assert_pair_generated_what_one_instance_did(
        pd_pair, run, expected, prefill_before, decode_before
    )


@EACH_PAIR
def test_every_prompt_at_once_through_the_pair_generates_what_one_instance_generates(
    pd_pair: Any, expected: list[Completion]
) -> None:
    prefill_before = prompt_tokens_by_source(pd_pair.prefill)
    decode_before = prompt_tokens_by_source(pd_pair.decode)
    with ThreadPoolExecutor(max_workers=len(PROMPTS)) as pool:
        run = list(pool.map(lambda prompt: complete_through_pair(pd_pair, prompt), PROMPTS))
    _assert_pair_generated_what_one_instance_did(
        pd_pair, run, expected, prefill_before, decode_before
    )


def test_what_the_tiny_model_generates_depends_on_the_whole_prompt(
    single_instance: Any, expected: list[Completion]
) -> None:
    """Otherwise D could match the single instance with a wrong or empty KV cache: the
    prompts' continuations differ, and so do those of the longest prompt with any one of
    its first 200 tokens changed (D computes at most its last token itself)."""
    assert len({completion.token_ids for completion in expected}) == len(PROMPTS)
    longest = max((p for p in PROMPTS if isinstance(p, list)), key=len)
    changed = list(longest)
    changed[len(longest) // 2] = 3 if longest[len(longest) // 2] != 3 else 4
    altered = complete(single_instance.url, changed, MAX_TOKENS, None)
    assert altered.token_ids != expected[PROMPTS.index(longest)].token_ids


@EACH_PAIR
def test_transfers_beside_local_requests_and_kvdefrag_moving_blocks(
    pd_pair: Any, expected: list[Completion]
) -> None:
    """Every prompt through the pair, and each prompt also sent as a plain request to P
    and to D, all at once: the plain requests decode while the transfers' requests come
    and go, so holes open under them and kvdefrag (threshold 0) moves blocks while the
    connector reads and writes others. Every completion is still the single instance's,
    and on each side kvdefrag runs on it moved blocks and no move failed."""
    plain = [(instance, prompt) for instance in (pd_pair.prefill, pd_pair.decode)
             for prompt in PROMPTS]  # fmt: skip
    with ThreadPoolExecutor(max_workers=len(PROMPTS) + len(plain)) as pool:
        through_pair = [pool.submit(complete_through_pair, pd_pair, prompt) for prompt in PROMPTS]
        local = [
            pool.submit(complete, instance.url, prompt, MAX_TOKENS, None)
            for instance, prompt in plain
        ]
        decoded = [future.result()[1] for future in through_pair]
        completed = [future.result() for future in local]
    assert [c.token_ids for c in decoded] == [c.token_ids for c in expected]
    assert [c.token_ids for c in completed] == [c.token_ids for c in expected] * 2
    for side in (side for side in (pd_pair.prefill, pd_pair.decode) if side.is_kvdefrag):
        moved = sum(side.metric("kvdefrag_moved_blocks_total", kvdefrag=True).values())
        healthy = side.metric("kvdefrag_healthy", kvdefrag=True)
        assert moved > 0, f"{side.name}: kvdefrag moved no block"
        assert set(healthy.values()) == {1.0}, f"{side.name}: {healthy}"
