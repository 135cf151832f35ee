"""The multi-turn benchmark on SmolLM2's tokenizer (evidence spans, lengths) and one tiny-model server
run of its runner."""

from __future__ import annotations

import pytest

from benchmarks import conversations as C


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


def _count(tok):
    return lambda s: len(tok(s, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("task", C.TASKS)
# 8192 tokens: the same checks on conversations 8x longer, most of this module's time: -m slow
@pytest.mark.parametrize("length", [1024, pytest.param(8192, marks=pytest.mark.slow)])
def test_evidence_spans_contain_the_answer(task, length, tokenizer):
    for seed in range(3):
        conv = C.generate(task, seed, 2 + seed, length, _count(tokenizer))
        C.attach_token_spans(conv, tokenizer)
        for t, turn in enumerate(conv.turns):
            assert turn.question in turn.user
            assert turn.evidence and all(ev.turn <= t for ev in turn.evidence)
            assert sorted({ev.turn for ev in turn.evidence}) == turn.depends_on
            found = []
            for ev in turn.evidence:
                user = conv.turns[ev.turn].user
                a, b = ev.char_span
                ids = tokenizer(user, add_special_tokens=False)["input_ids"]
                decoded = tokenizer.decode(ids[ev.token_span[0] : ev.token_span[1]])
                assert user[a:b] in decoded  # the token span covers the character span
                found.append(user[a:b])
            answers = turn.answer if isinstance(turn.answer, list) else [turn.answer]
            text = " ".join(found)
            if task == "count":  # one evidence span per occurrence of the counted event
                assert len(found) == int(turn.answer)
            else:
                assert all(ans in text for ans in answers), (task, t, answers, text[:200])
            # nothing outside the recorded evidence gives the answer away (passkey/kv values are unique)
            if task in ("passkey", "kv"):
                hits = sum(u.user.count(turn.answer) for u in conv.turns[: t + 1])
                assert hits == sum(e.count(turn.answer) for e in found)


@pytest.mark.parametrize("length", [1024, 2048, 4096, 8192])
def test_lengths_and_turns(length, tokenizer):
    count = _count(tokenizer)
    for task in C.TASKS:
        conv = C.generate(task, 1, 4, length, count)
        last = tokenizer.apply_chat_template(conv.messages(3), tokenize=False, add_generation_prompt=True)
        assert 0.75 * length <= count(last) <= 1.1 * length, (task, count(last))


@pytest.mark.server
def test_runner_plays_a_conversation(tiny_server):
    """The runner's streaming chat turn against a live (tiny random-weight) server."""
    from benchmarks.common import chat_turn

    conv = C.generate("passkey", 0, 2, 512)
    for t in range(2):
        res = chat_turn(tiny_server.url, conv.messages(t), 8, "sglang")
        assert res["ttft_s"] <= res["total_s"] and res["completion_tokens"] >= 1
        assert res["cached_details"] is not None or res["cached_tokens"] is not None
    # the second turn found the first turn's prefix cached (at least the system prompt)
    assert (res["cached_tokens"] or 0) > 0
