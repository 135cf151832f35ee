"""The multi-turn benchmark's generator, scoring and systems table (no tokenizer, no server)."""

from __future__ import annotations

import pytest

from benchmarks import conversations as C


def test_generator_is_deterministic_by_seed():
    a = C.generate("kv", 3, 4, 2048).to_dict()
    assert a == C.generate("kv", 3, 4, 2048).to_dict()
    assert a != C.generate("kv", 4, 4, 2048).to_dict()
    s1 = [c.to_dict() for c in C.suite(C.TASKS, 2, [1024, 2048], (2, 5), 7, C._approx_tokens)]
    assert s1 == [c.to_dict() for c in C.suite(C.TASKS, 2, [1024, 2048], (2, 5), 7, C._approx_tokens)]


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
