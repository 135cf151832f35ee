"""The cluster benchmark's failover drill: which worker it kills and which turns it times."""

from benchmarks.cluster import busiest_worker, mark_cross_worker, mark_failover


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
