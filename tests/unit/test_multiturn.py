"""The multi-turn benchmark's generator and scoring (fast), and one tiny-model server run of its runner."""

from __future__ import annotations

import pytest

from benchmarks import conversations as C


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


def _count(tok):
    return lambda s: len(tok(s, add_special_tokens=False)["input_ids"])


def test_generator_is_deterministic_by_seed():
    a = C.generate("kv", 3, 4, 2048).to_dict()
    assert a == C.generate("kv", 3, 4, 2048).to_dict()
    assert a != C.generate("kv", 4, 4, 2048).to_dict()
    s1 = [c.to_dict() for c in C.suite(C.TASKS, 2, [1024, 2048], (2, 5), 7, C._approx_tokens)]
    assert s1 == [c.to_dict() for c in C.suite(C.TASKS, 2, [1024, 2048], (2, 5), 7, C._approx_tokens)]


@pytest.mark.parametrize("task", C.TASKS)
@pytest.mark.parametrize("length", [1024, 8192])
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


def test_question_positions_and_earlier_only_evidence():
    convs = C.suite(C.TASKS, 6, [1024, 2048], (2, 5), 0, C._approx_tokens)
    turns = [t for c in convs for t in c.turns]
    assert {t.position for t in turns} == set(C.POSITIONS)
    for t in turns:
        q_at = t.user.index(t.question)
        where = {"begin": q_at == 0, "end": q_at + len(t.question) == len(t.user)}
        assert where.get(t.position, 0 < q_at and q_at + len(t.question) < len(t.user)), t.position
    # evidence only in an earlier turn happens for every task with per-turn evidence
    earlier = {c.task for c in convs for i, t in enumerate(c.turns) if max(t.depends_on) < i}
    assert {"passkey", "kv", "trec"} <= earlier


def test_scoring_perfect_wrong_partial():
    for task in C.TASKS:
        turn = C.generate(task, 0, 3, 1024).turns[-1]
        assert C.score(turn, turn.gold_reply) == 1.0
        assert C.score(turn, "I do not know.") == 0.0
    kv = C.generate("kv", 0, 2, 1024).turns[0]
    assert C.score(kv, f"The value is {kv.answer}.") == 1.0
    assert C.score(kv, f"The value is {kv.answer}1.") == 0.0  # a longer number is wrong
    count = C.generate("count", 0, 2, 1024).turns[1]
    assert C.score(count, f"{int(count.answer) + 1}, not {count.answer}") == 0.0  # the first number counts
    trec = C.generate("trec", 0, 2, 1024).turns[0]
    assert C.score(trec, f"Type: {trec.answer}.") == 1.0
    assert C.score(trec, " ".join(C.TREC_LABELS)) == float(C.TREC_LABELS[0] == trec.answer)
    var = C.generate("vartrack", 0, 3, 1024).turns[-1]
    assert C.f1(", ".join(var.answer[:1]), var.answer) == pytest.approx(
        2 * (1 / len(var.answer)) / (1 + 1 / len(var.answer))
    )
    assert 0 < C.score(var, var.answer[0]) < 1


def test_quick_systems_table():
    from benchmarks.multiturn import SYSTEMS

    names = [s.name for s in SYSTEMS]
    assert len(names) == len(set(names)) and {"stock", "dense", "all", "llamacpp"} <= set(names)
    assert all(s.requires is None or isinstance(s.requires, str) for s in SYSTEMS)


def test_runner_plays_a_conversation(tiny_server):
    """The runner's streaming chat turn against a live (tiny random-weight) server."""
    from benchmarks.multiturn import chat_turn

    conv = C.generate("passkey", 0, 2, 512)
    for t in range(2):
        res = chat_turn(tiny_server.url, conv.messages(t), 8, "sglang")
        assert res["ttft_s"] <= res["total_s"] and res["completion_tokens"] >= 1
        assert res["cached_details"] is not None or res["cached_tokens"] is not None
    # the second turn found the first turn's prefix cached (at least the system prompt)
    assert (res["cached_tokens"] or 0) > 0
