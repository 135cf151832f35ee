"""The cluster benchmark's failover drill: which worker it kills and which turns it times."""

from benchmarks.cluster import busiest_worker, mark_cross_worker, mark_failover, summarize_shape


def turn(conv: str, t: int, worker: str | None) -> dict:
    return {"conv": conv, "turn": t, "worker": worker}


def test_the_drill_kills_the_worker_that_served_the_most_conversations_last():
    turns = [turn("a", 1, "w1"), turn("b", 1, "w2"), turn("c", 1, "w2"), turn("c", 0, "w1"), turn("d", 1, None)]
    assert busiest_worker(turns, 2) == "w2"
    assert busiest_worker(turns, 5) is None


def test_a_failover_turn_is_the_first_turn_after_the_loss_of_the_worker_that_served_the_one_before():
    turns = [
        turn("a", 0, "w1"), turn("a", 1, "w2"), turn("a", 2, "w1"), turn("a", 3, "w1"),
        turn("b", 0, "w1"), turn("b", 1, "w1"), turn("b", 2, "w1"),
        turn("c", 0, "w2"), turn("c", 1, "w2"),  # ended before the loss: nothing moved
    ]  # fmt: skip
    mark_failover(turns, "w2", 2)
    mark_cross_worker(turns)
    assert [(x["conv"], x["turn"]) for x in turns if x["failover"]] == [("a", 2)]
    assert next(x for x in turns if x["failover"])["cross"]  # and counted among the worker changes
    mark_failover(turns, None, 2)
    assert not any(x["failover"] for x in turns)


def played(workers: list[str], ttfts: list[float], shared: bool) -> dict:
    """One conversation's turns on ``workers`` in order, as run_config returns them."""
    turns = [
        turn("a", t, w) | {"ttft_s": s, "answer": "x", "cached_tokens": 16, "score": 1.0, "storage_shared": 16 * shared}
        for t, (w, s) in enumerate(zip(workers, ttfts))
    ]
    return {"turns": turns, "wall_s": 60.0}


def test_a_four_worker_round_robin_pair_is_summarised_under_its_own_keys_beside_the_two_worker_pair():
    ws = ["w1", "w2", "w3", "w1"]  # turns 1 and 2 first visits, turn 3 a return to w1
    s = summarize_shape(
        {
            "2w-shared-rr": played(["w1", "w2", "w1", "w2"], [9, 1, 1, 1], True),
            "2w-private-rr": played(["w1", "w2", "w1", "w2"], [9, 8, 2, 2], False),
            "4w-shared-rr": played(ws, [9, 1, 1, 1], True),
            "4w-private-rr": played(ws, [9, 8, 8, 4], False),
        }
    )
    assert s["ttft_ratio_private_over_shared_round_robin"] == 2.0
    assert s["ttft_ratio_private_over_shared_round_robin_4w"] == 8.0
    assert s["ttft_ratio_private_over_shared_rr_first_visit_4w"] == 8.0
    assert s["cross_worker_hit_fraction_round_robin_4w"] == 1.0
    assert s["cross_worker_answers_identical_rr_4w"] == "3/3"
    assert s["ttft_ratio_private_over_shared_round_robin_3w"] is None  # no three-worker pair played


def test_the_paired_ratio_compares_only_the_turns_that_changed_worker_in_both_runs():
    s = summarize_shape(
        {
            "2w-shared-rr": played(["w1", "w2", "w1", "w2"], [9, 1, 2, 3], True),
            "2w-private-rr": played(["w1", "w1", "w2", "w1"], [9, 1, 8, 6], False),  # turn 1 stayed
        }
    )
    assert s["cross_worker_turns_paired_rr"] == 2  # turns 2 and 3
    assert s["ttft_ratio_private_over_shared_rr_paired"] == 7 / 2.5
    assert s["ttft_ratio_private_over_shared_rr"] == 7 / 2  # p50 over {8, 6} vs over {1, 2, 3}
