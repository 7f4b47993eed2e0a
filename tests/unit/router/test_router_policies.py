"""Selection policies and the supervisor's role split."""

from __future__ import annotations

import random
from collections import Counter

from vllm_pd.router.config import InstanceConfig, ProxyConfig
from vllm_pd.router.pool.instance_pool import InFlightLeg, InstancePool
from vllm_pd.router.pool.supervisor import Supervisor
from vllm_pd.router.routing.policies import LeastOutstanding, PowerOfTwo, PrefixAware, RoundRobin


def _pool(n: int, role: str = "prefill") -> InstancePool:
    return InstancePool(ProxyConfig(instances=[InstanceConfig(f"http://h{i}:1", role) for i in range(n)]))


def test_round_robin_cycles() -> None:
    pool = _pool(3)
    rr = RoundRobin()
    picks = [rr.choose(pool.eligible("prefill"), "prefill", "", 1).url for _ in range(6)]
    assert picks == ["http://h0:1", "http://h1:1", "http://h2:1"] * 2


def test_least_outstanding_counts_requests_then_tokens() -> None:
    pool = _pool(3)
    a, b, c = pool.all()
    InFlightLeg(a, "prefill", 10)
    InFlightLeg(b, "prefill", 5000)
    lo = LeastOutstanding()
    assert lo.choose(pool.all(), "prefill", "", 1) is c
    InFlightLeg(c, "prefill", 100)
    assert lo.choose(pool.all(), "prefill", "", 1) is a  # equal requests: fewer tokens wins
    leg = InFlightLeg(a, "decode", 1)
    assert lo.choose(pool.all(), "prefill", "", 1) is c  # decode legs load the instance too
    leg.finish()
    leg.finish()  # idempotent
    assert a.outstanding["decode"] == 0


def test_power_of_two_avoids_the_busiest() -> None:
    pool = _pool(2)
    busy, idle = pool.all()
    for _ in range(5):
        InFlightLeg(busy, "decode", 1)
    p2 = PowerOfTwo(random.Random(0))
    assert {p2.choose(pool.all(), "decode", "", 1).url for _ in range(20)} == {idle.url}


def test_prefix_aware_sticks_to_prefix_owner_and_spreads_others() -> None:
    pool = _pool(4)
    pa = PrefixAware(chunk_chars=16)
    sys_a = "You are agent A. " * 10
    sys_b = "You are agent B. " * 10
    first_a = pa.choose(pool.all(), "prefill", sys_a + "question 1", 10)
    first_b = pa.choose(pool.all(), "prefill", sys_b + "question 1", 10)
    for q in range(2, 10):
        assert pa.choose(pool.all(), "prefill", sys_a + f"question {q}", 10) is first_a
        assert pa.choose(pool.all(), "prefill", sys_b + f"question {q}", 10) is first_b
    # unrelated prompts spread (least outstanding among equals rotates)
    picks = Counter(pa.choose(pool.all(), "prefill", f"{i} unrelated text of its own " * 3, 10).url for i in range(8))
    assert len(picks) == 4
    # an overloaded owner is bypassed
    for _ in range(10):
        InFlightLeg(first_a, "prefill", 1)
    assert pa.choose(pool.all(), "prefill", sys_a + "question 99", 10) is not first_a


def test_prefix_aware_memory_is_bounded() -> None:
    pool = _pool(2)
    pa = PrefixAware(chunk_chars=8, max_entries=100)
    for i in range(1000):
        pa.choose(pool.all(), "prefill", f"prompt number {i} " * 5, 10)
    assert len(pa) == 100


def _clients_see(pool: InstancePool, ttft: float, tpot: float, n: int = 5) -> None:
    """Samples of what clients saw (after a move the supervisor counts only samples taken since)."""
    for _ in range(n):
        pool.recent_ttft.add(ttft)
        pool.recent_tpot.add(tpot)


def test_supervisor_moves_both_instances_with_the_mix() -> None:
    pool = InstancePool(
        ProxyConfig(
            instances=[InstanceConfig(f"http://b{i}:1", "both") for i in range(4)]
            + [InstanceConfig("http://fixed:1", "prefill")]
        )
    )
    sup = Supervisor(pool, ttft_slo=1.0, tpot_slo=0.05)
    roles = Counter(sup.rebalance().values())
    assert roles == {"decode": 2, "prefill": 2}  # first split: alternate
    # long prompts: TTFT misses its target while TPOT is fine -> instances move to prefill, one per call
    _clients_see(pool, 3.0, 0.01, 20)
    assert Counter(sup.rebalance().values()) == {"prefill": 3, "decode": 1}
    _clients_see(pool, 3.0, 0.01)
    assert Counter(sup.rebalance().values()) == {"prefill": 3, "decode": 1}  # the last decoder stays
    # long outputs: TPOT misses, TTFT fine -> back to decode (the first move back undoes the last move:
    # it needs a pressure over the dead band times the 3.0 that made that one, 3 intervals in a row - TPOT 4 x
    # its target is)
    for _ in range(5):
        _clients_see(pool, 0.2, 0.2, 20)
        sup.rebalance()
    _clients_see(pool, 0.2, 0.2, 20)
    assert Counter(sup.rebalance().values()) == {"decode": 4}
    assert sup.moves == 4
    flex = [i for i in pool.all() if i.role == "both"]
    assert all(i.serves("decode") and not i.serves("prefill") for i in flex)
    assert [i.url for i in pool.eligible("prefill")] == ["http://fixed:1"]
    # both within target: nothing moves
    _clients_see(pool, 0.2, 0.03, 60)
    sup.rebalance()
    assert sup.moves == 4


def test_supervisor_reads_the_prefill_queue_before_completions_do() -> None:
    pool = InstancePool(ProxyConfig(instances=[InstanceConfig(f"http://b{i}:1", "both") for i in range(3)]))
    sup = Supervisor(pool, ttft_slo=1.0, tpot_slo=0.05)
    sup.rebalance()
    prefiller = next(i for i in pool.all() if i.active_role == "prefill")
    prefiller.ttft.add(0.5)
    for _ in range(8):
        InFlightLeg(prefiller, "prefill", 1000)  # 8 queued x 0.5 s = 4 s predicted TTFT
    assert sup.pressures()[0] > 3
    sup.rebalance()
    assert Counter(i.active_role for i in pool.all())["prefill"] == 2
