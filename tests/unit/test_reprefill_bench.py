"""The re-prefill benchmark's recommended budget: the smallest meeting both fidelity targets."""

from benchmarks.reprefill import default_mt_budgets, multiturn_min, recommend

BUDGETS = [0.1, 0.5, 0.75, 0.9]
AGREE = {"0.1": 0.91, "0.5": 0.969, "0.75": 0.984, "0.9": 1.0, "1.0": 1.0}


def test_the_recommendation_needs_both_targets_where_the_multi_turn_part_ran():
    assert recommend(BUDGETS, AGREE, {"0.5": 0.68, "0.75": 0.83, "0.9": 0.995}) == 0.9
    # a multi-turn pass below the agreement target does not count
    assert recommend(BUDGETS, AGREE, {"0.1": 1.0, "0.9": 0.99}) == 0.9


def test_without_a_passing_multi_turn_run_the_agreement_target_decides():
    assert recommend(BUDGETS, AGREE, {}) == 0.5
    assert recommend(BUDGETS, AGREE, {"0.5": 0.68, "0.9": 0.9}) == 0.5
    assert recommend(BUDGETS, {b: 0.9 for b in AGREE}, {}) == 1.0


def test_the_multi_turn_part_runs_every_budget_that_agrees_or_else_the_best():
    payload = {
        "systems": {"loopkv": {"host": {str(b): {} for b in BUDGETS}}},
        "summary": {"teacher_forced_agreement_by_budget": AGREE},
    }
    assert default_mt_budgets(payload) == [0.5, 0.75, 0.9]
    payload["summary"]["teacher_forced_agreement_by_budget"] = {**{b: 0.9 for b in AGREE}, "0.5": 0.93}
    assert default_mt_budgets(payload) == [0.5]


def test_multi_turn_minimum_is_over_question_positions_not_the_overall_score():
    mt = {
        "config": {},
        "reprefill_mt_dense": {},
        "reprefill_mt_b0.9": {"score_ratio_vs_dense": {"begin": 1.0, "middle": 0.97, "end": None, "all": 0.5}},
    }
    assert multiturn_min(mt) == {"0.9": 0.97}
