"""API conformance through the real client libraries: SGLang's frontend language (gen, select, fork,
streaming, multi-turn chat), the ``openai`` package (chat and completions, streaming usage with cached
tokens per tier), native ``/generate`` with batch input, ``/model_info``, ``/server_info``,
``/flush_cache`` (every tier), ``/health``, ``/health_generate`` and ``/metrics``.

``tiny_server`` serves the plain cases; ``keyed_server`` (API keys, a ~2-conversation device pool, an
explicit disk directory, metrics on) the per-tier hits, the flush and the metrics."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from sgl_loopkv.server.pool_size import paged_pool_tokens
from tests.e2e.conftest import ADMIN_KEY, API_KEY

pytestmark = pytest.mark.server

KEY = {"Authorization": f"Bearer {API_KEY}"}


def facts(tag: str, n: int) -> str:
    """A prompt of ~17 tokens per fact; ``tag`` (in its first page) keeps it unseen by earlier requests."""
    return f"Record {tag}. " + " ".join(f"Shelf {j} of {tag} holds {(j * 7) % 11} jars." for j in range(n))


def generate(url: str, text, headers: dict | None = None, **sampling) -> dict | list:
    body = {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": 8, **sampling}}
    r = requests.post(f"{url}/generate", json=body, headers=headers, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def tiers(details: dict | None) -> dict[str, int]:
    d = details or {}
    return {"device": d.get("device", 0), "host": d.get("host", 0), "disk": d.get("storage") or 0}


def metrics(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample on /metrics: (name, sorted labels) -> value."""
    text = requests.get(f"{url}/metrics", timeout=30).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(samples: dict, name: str, **labels) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (SGLang adds its own labels)."""
    hits = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls)]
    assert hits, f"{name}{labels} not on /metrics; names: {sorted({n for n, _ in samples})}"
    return sum(hits)


# --- SGLang frontend language -------------------------------------------------------------------------
def test_frontend_gen_select_fork(tiny_server):
    import sglang as sgl

    @sgl.function
    def program(s, question):
        s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=6, temperature=0, ignore_eos=True)
        s += "\nThe colour is" + sgl.select("colour", choices=[" red", " blue", " green"])
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f"\nIdea {i}:" + sgl.gen("idea", max_tokens=4, temperature=0, ignore_eos=True)
        forks.join()
        s["ideas"] = [f["idea"] for f in forks]
        s["fork_texts"] = [f.text() for f in forks]

    state = program.run(question="What is 2+2?", backend=sgl.RuntimeEndpoint(tiny_server.url))
    # gen: greedy, so the same text through /generate gives the same continuation
    direct = generate(tiny_server.url, "Q: What is 2+2?\nA:", max_new_tokens=6, ignore_eos=True)
    assert state["answer"] == direct["text"]
    assert state.get_meta_info("answer")["completion_tokens"] == 6
    # select: the choice with the best normalized prompt logprob, as the server scored it
    meta = state.get_meta_info("colour")
    scores = meta["normalized_prompt_logprobs"]
    assert len(scores) == 3 and state["colour"] == [" red", " blue", " green"][scores.index(max(scores))]
    # fork: two branches continuing the parent's text, each with its own generation
    prefix = "Q: What is 2+2?\nA:" + state["answer"] + "\nThe colour is" + state["colour"]
    assert len(state["ideas"]) == 2 and all(isinstance(x, str) and x for x in state["ideas"])
    for i, text in enumerate(state["fork_texts"]):
        assert text.startswith(prefix + f"\nIdea {i}:")


def test_frontend_streaming_yields_increments(tiny_server):
    import sglang as sgl

    @sgl.function
    def program(s):
        s += "Once upon a time" + sgl.gen("story", max_tokens=8, temperature=0, ignore_eos=True)

    state = program.run(backend=sgl.RuntimeEndpoint(tiny_server.url), stream=True)
    pieces = list(state.text_iter("story"))
    assert len(pieces) >= 2, pieces  # incremental, not one final blob
    assert "".join(pieces) == state["story"]
    assert state.get_meta_info("story")["completion_tokens"] == 8


def test_frontend_multi_turn_chat_reuses_the_first_turn(tiny_server):
    import sglang as sgl

    system = facts(uuid.uuid4().hex[:8], 12)  # > 8 pages of 16 tokens: turn 2 must find them cached

    @sgl.function
    def chat(s):
        s += sgl.system(system)
        s += sgl.user("Which shelf holds 3 jars?")
        s += sgl.assistant(sgl.gen("first", max_tokens=5, temperature=0))
        s += sgl.user("And 5 jars?")
        s += sgl.assistant(sgl.gen("second", max_tokens=5, temperature=0))

    state = chat.run(backend=sgl.RuntimeEndpoint(tiny_server.url))
    msgs = state.messages()
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    assert msgs[2]["content"] == state["first"] and msgs[4]["content"] == state["second"]
    first, second = state.get_meta_info("first"), state.get_meta_info("second")
    assert first["cached_tokens"] < 16 < second["cached_tokens"] <= first["prompt_tokens"] + first["completion_tokens"]


# --- openai client ------------------------------------------------------------------------------------
def test_openai_chat_and_completions(tiny_server, tiny_model_dir):
    import openai

    client = openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    assert model == str(tiny_model_dir)  # the served name (no --served-model-name: the path)
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say hi."}],
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert chat.object == "chat.completion" and chat.model == model
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == 6
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + 6
    done = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert done.object == "text_completion" and done.usage.completion_tokens == 6
    direct = generate(tiny_server.url, "The capital of France is", max_new_tokens=6, ignore_eos=True)
    assert done.choices[0].text == direct["text"]  # the same greedy continuation as /generate


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_openai_streaming_usage_reports_cached_tokens_per_tier(tiny_server, api):
    """``stream_options.include_usage``: the last chunk carries usage with SGLang's
    ``prompt_tokens_details.cached_tokens``; ``return_cached_tokens_details`` adds our per-tier
    split in ``sglext``, and the tiers add up to ``cached_tokens``."""
    import openai

    client = openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    prompt = facts(uuid.uuid4().hex[:8], 30)  # ~500 tokens
    kwargs = dict(model=model, max_tokens=5, temperature=0, extra_body={"return_cached_tokens_details": True})
    create = client.chat.completions.create if api == "chat" else client.completions.create
    if api == "chat":
        kwargs["messages"] = [{"role": "user", "content": prompt}]
    else:
        kwargs["prompt"] = prompt

    def stream() -> tuple[str, object, dict | None]:
        text, usage, details = [], None, None
        for chunk in create(stream=True, stream_options={"include_usage": True}, **kwargs):
            for c in chunk.choices:
                text.append((c.delta.content if api == "chat" else c.text) or "")
            if chunk.usage is not None:
                assert not chunk.choices  # the usage chunk is the extra last one
                usage = chunk.usage
            ext = (chunk.model_extra or {}).get("sglext")
            if ext and ext.get("cached_tokens_details"):
                details = ext["cached_tokens_details"]
        return "".join(text), usage, details

    text1, usage1, _ = stream()
    assert usage1 is not None and usage1.prompt_tokens > 300
    # never seen (but the chat template's default system prompt may be: its first pages)
    assert usage1.prompt_tokens_details.cached_tokens < 64
    text2, usage2, details = stream()
    assert text2 == text1  # greedy, cache or not
    cached = usage2.prompt_tokens_details.cached_tokens
    assert usage1.prompt_tokens - 16 <= cached < usage2.prompt_tokens  # all whole pages, never the last token
    assert details is not None and details["storage_backend"] == "loopkv-disk"
    assert sum(tiers(details).values()) == cached and tiers(details)["device"] == cached  # still on the device
    # non-streaming: the same numbers in usage and sglext
    reply = create(**kwargs)
    assert reply.usage.prompt_tokens_details.cached_tokens == cached
    assert tiers(reply.model_extra["sglext"]["cached_tokens_details"])["device"] == cached


def conversation(tag: str, i: int) -> str:
    """~1000 tokens (tests/e2e/test_tiered_cache.py's, tagged): the keyed server's device pool holds ~2."""
    rooms = " ".join(
        f"In story {i}, room {j} holds {(i * 7 + j * 3) % 11} {['lamps', 'books', 'cups'][j % 3]}." for j in range(70)
    )
    return f"Conversation {tag}-{i}. {rooms}"


def test_openai_usage_counts_host_and_disk_hits(keyed_server):
    """Evicted histories come back from the host and disk tiers; SGLang's ``cached_tokens`` counts
    them (to SGLang a loaded token is a device hit) and ``sglext`` says where they came from."""
    import openai

    client = openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key=API_KEY)
    model = client.models.list().data[0].id
    tag = uuid.uuid4().hex[:8]

    def ask(i: int):
        reply = client.completions.create(
            model=model,
            prompt=conversation(tag, i) + " Question: how many jars?",
            max_tokens=4,
            temperature=0,
            extra_body={"return_cached_tokens_details": True},
        )
        ext = (reply.model_extra or {}).get("sglext") or {}
        return reply.usage.prompt_tokens_details.cached_tokens, tiers(ext.get("cached_tokens_details"))

    before = metrics(keyed_server.url)
    for i in range(6):  # the pool holds ~2, the host tier ~4: 0 and 1 end up on disk only
        ask(i)
    time.sleep(1)  # the disk writer is asynchronous
    cached, split = ask(3)  # evicted from the device pool, still in the host arena
    assert split["host"] > 800 and sum(split.values()) == cached, split
    cached, split = ask(0)
    assert split["disk"] > 800 and sum(split.values()) == cached, split
    after = metrics(keyed_server.url)
    for tier in ("host", "disk"):
        grown = sample(after, "loopkv_hit_tokens_total", tier=tier) - sample(
            before, "loopkv_hit_tokens_total", tier=tier
        )
        assert grown > 800, tier


# --- native API ---------------------------------------------------------------------------------------
def test_generate_batch_of_texts_and_of_token_ids(tiny_server):
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    batch = generate(tiny_server.url, texts, max_new_tokens=6, ignore_eos=True)
    assert isinstance(batch, list) and len(batch) == 3
    assert len({b["meta_info"]["id"] for b in batch}) == 3
    for text, out in zip(texts, batch):
        assert out["text"] == generate(tiny_server.url, text, max_new_tokens=6, ignore_eos=True)["text"]
    ids = [[1, 504, 3575, 282], [1, 2, 3, 4, 5]]
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True}}
    r = requests.post(f"{tiny_server.url}/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    assert [o["meta_info"]["prompt_tokens"] for o in r.json()] == [4, 5]


def test_model_info_and_server_info(tiny_server, tiny_model_dir):
    info = requests.get(f"{tiny_server.url}/model_info", timeout=30).json()
    assert info["model_path"] == str(tiny_model_dir) and info["is_generation"] is True
    assert requests.get(f"{tiny_server.url}/get_model_info", timeout=30).json()["model_path"] == str(tiny_model_dir)
    server = requests.get(f"{tiny_server.url}/server_info", timeout=30).json()
    assert server["attention_backend"] == "loopkv" and server["radix_cache_backend"] == "loopkv"
    assert server["host"] == "127.0.0.1" and server["port"] == tiny_server.port
    assert server["model_path"] == str(tiny_model_dir) and server["version"]


def test_health_and_health_generate(tiny_server):
    for path in ("/health", "/health_generate"):
        r = requests.get(f"{tiny_server.url}{path}", timeout=120)
        assert r.status_code == 200, (path, r.text)


def test_metrics_show_sglang_and_loopkv_counters(keyed_server):
    before = metrics(keyed_server.url)
    out = generate(keyed_server.url, facts(uuid.uuid4().hex[:8], 5), headers=KEY, max_new_tokens=3, ignore_eos=True)
    after = metrics(keyed_server.url)
    prompt = out["meta_info"]["prompt_tokens"]
    assert sample(after, "sglang:prompt_tokens_total") - sample(before, "sglang:prompt_tokens_total") >= prompt
    assert sample(after, "sglang:generation_tokens_total") - sample(before, "sglang:generation_tokens_total") >= 3
    assert sample(after, "sglang:max_total_num_tokens") == paged_pool_tokens(2048, 16)  # --max-total-tokens 2048
    assert sample(after, "loopkv_tier_bytes", tier="host") > 0  # the turn was stored
    for name in ("loopkv_tier_tokens", "loopkv_disk_bytes_read_total", "loopkv_corrupt_segments_total"):
        sample(after, name)


def test_metrics_survive_a_metrics_file_being_created(keyed_server):
    """A scrape while some process has created its metrics file but not sized it yet (or was killed
    in between): SGLang's /metrics answered 500 and lost every metric (server/metrics_files.py)."""
    import psutil

    dirs = {psutil.Process(p).environ().get("PROMETHEUS_MULTIPROC_DIR") for p in keyed_server.pids()[1:]}
    (mp_dir,) = dirs - {None}  # the launcher sets it before starting the scheduler and detokenizer
    empty = Path(mp_dir) / "counter_4194304.db"  # no process has this pid (Linux pids are below 2**22)
    empty.touch()
    try:
        r = requests.get(f"{keyed_server.url}/metrics", timeout=30)
        assert r.status_code == 200, r.text[-2000:]
        assert "loopkv_tier_bytes" in r.text and "sglang:max_total_num_tokens" in r.text
    finally:
        empty.unlink()


# --- /flush_cache -------------------------------------------------------------------------------------
def segment_files(disk_dir) -> list:
    return sorted(disk_dir.glob("*/seg_*.kv"))


def test_flush_cache_empties_device_host_and_disk(keyed_server, keyed_disk_dir):
    prompt = facts(uuid.uuid4().hex[:8], 30)
    generate(keyed_server.url, prompt, headers=KEY, max_new_tokens=2)
    again = generate(keyed_server.url, prompt, headers=KEY, max_new_tokens=2)
    assert again["meta_info"]["cached_tokens"] > 300
    deadline = time.monotonic() + 30
    while not segment_files(keyed_disk_dir) and time.monotonic() < deadline:  # the disk writer is asynchronous
        time.sleep(0.2)
    assert segment_files(keyed_disk_dir)
    assert sample(metrics(keyed_server.url), "loopkv_tier_tokens", tier="host") > 0

    r = requests.post(f"{keyed_server.url}/flush_cache", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60)
    assert r.status_code == 200, r.text

    assert segment_files(keyed_disk_dir) == []
    assert not [p for p in keyed_disk_dir.glob("*/chunks/*")]  # no chunk link left either
    now = metrics(keyed_server.url)
    for tier in ("host", "disk"):
        assert sample(now, "loopkv_tier_bytes", tier=tier) == 0, tier
        assert sample(now, "loopkv_tier_tokens", tier=tier) == 0, tier
    after = generate(keyed_server.url, prompt, headers=KEY, max_new_tokens=2)
    assert after["meta_info"]["cached_tokens"] == 0  # from no tier
    assert tiers(after["meta_info"].get("cached_tokens_details")) == {"device": 0, "host": 0, "disk": 0}
    assert generate(keyed_server.url, prompt, headers=KEY, max_new_tokens=2)["meta_info"]["cached_tokens"] > 300
