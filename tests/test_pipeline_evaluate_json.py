"""The evidence's JSON for long lists, the case of a huge snapshot: the writers' fast paths (process
names and holdings joined as text) give ``MessageToJson``'s text exactly,
and so do their fallbacks when one name needs escaping, one is empty, an amount is 0 or a holding
is a channel's. No Spark.
"""

from __future__ import annotations

import pytest
from google.protobuf import json_format
from hypothesis import given, settings
from hypothesis import strategies as st

from stablewatch.pipeline.evaluate import _conservation_json, evidence_json
from stablewatch.v1 import (
    ChannelRef,
    ConservationEvidence,
    CounterHolding,
    DeadlockEvidence,
    PredicateResult,
    WaitNode,
)

pytestmark = pytest.mark.timeout(300)

#: Names json.dumps writes as themselves, as process ids are.
_PLAIN = st.text(
    st.characters(min_codepoint=0x20, max_codepoint=0x7E, exclude_characters='"\\'), min_size=1, max_size=6
)
#: Names it escapes (or leaves out, empty): one of them sends a list to the general path.
_ODD = st.sampled_from(['"', "\\", "a\x00", "\x1f", "\x7f", "é", "\u2028", "💥", ""])
_INT64 = st.one_of(st.integers(-(2**63), 2**63 - 1), st.sampled_from([1, -1, 2**63 - 1, -(2**63)]))


@st.composite
def names(draw: st.DrawFn, max_size: int = 60) -> list[str]:
    """Plain names, and now and then one odd name among them."""
    drawn = draw(st.lists(_PLAIN, min_size=1, max_size=max_size))
    if draw(st.integers(0, 3)) == 0:
        drawn[draw(st.integers(0, len(drawn) - 1))] = draw(_ODD)
    return drawn


def message_to_json(result: PredicateResult) -> str:
    evidence = getattr(result, str(result.WhichOneof("evidence")))
    return json_format.MessageToJson(evidence, indent=None, preserving_proto_field_name=True, sort_keys=True)


@settings(max_examples=300, derandomize=True, deadline=None)
@given(names(), names(), st.booleans(), st.integers(0, 2**32 - 1))
def test_long_lists_of_nodes(processes: list[str], tasks: list[str], with_tasks: bool, separate: int) -> None:
    result = PredicateResult(name="deadlock")
    nodes = [WaitNode(process=p, task=tasks[i % len(tasks)] if with_tasks else "") for i, p in enumerate(processes)]
    result.deadlock.CopyFrom(
        DeadlockEvidence(deadlocked=nodes, cycle=nodes[:3], knot=nodes[::2], separate_deadlocks=separate)
    )
    assert evidence_json(result) == message_to_json(result)


@settings(max_examples=300, derandomize=True, deadline=None)
@given(names(), st.data())
def test_long_lists_of_holdings(processes: list[str], data: st.DataObject) -> None:
    result = PredicateResult(name="conservation(tokens)")
    evidence = result.conservation
    evidence.counter, evidence.expected, evidence.observed = "tokens", data.draw(_INT64), data.draw(_INT64)
    for process in processes:
        holding = CounterHolding(amount=data.draw(_INT64))
        if process:
            holding.process = process
        else:  # a channel's holding, in place of an empty name
            holding.channel.CopyFrom(ChannelRef(src="a", dst=data.draw(_PLAIN)))
        evidence.holdings.append(holding)
    if data.draw(st.integers(0, 3)) == 0:  # an amount of 0: left out of its holding
        evidence.holdings[data.draw(st.integers(0, len(processes) - 1))].amount = 0
    assert evidence_json(result) == message_to_json(result)


def test_a_hundred_thousand_holdings_and_nodes() -> None:
    """The sizes the fast paths are for, with every amount's extreme."""
    amounts = [1, -1, 2**63 - 1, -(2**63), 42]
    result = PredicateResult(name="conservation(tokens)")
    result.conservation.counter = "tokens"
    result.conservation.holdings.extend(
        CounterHolding(process=f"service-{i:08d}", amount=amounts[i % len(amounts)]) for i in range(100_000)
    )
    assert evidence_json(result) == message_to_json(result)
    deadlock = PredicateResult(name="deadlock")
    deadlock.deadlock.deadlocked.extend(WaitNode(process=f"service-{i:08d}") for i in range(100_000))
    assert evidence_json(deadlock) == message_to_json(deadlock)


def test_holdings_of_an_unnamed_process_from_rows() -> None:
    """Rows can hold an empty process name (a message does not): its holding has the amount alone."""
    holdings = [("p", 3), ("", 5), ("q", -1)]
    evidence = ConservationEvidence(
        counter="tokens", holdings=[CounterHolding(process=p, amount=a) for p, a in holdings]
    )
    expected = json_format.MessageToJson(evidence, indent=None, preserving_proto_field_name=True, sort_keys=True)
    assert _conservation_json(evidence, holdings) == expected
