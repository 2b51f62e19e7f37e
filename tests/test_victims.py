"""The victim of a proven deadlock: one wait per sink component, chosen by policy, the same on every
cut that shows the deadlock (DESIGN.md, "Breaking a proven deadlock")."""

from __future__ import annotations

import random
from collections.abc import Container
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stablewatch.detector.evaluation import POLICIES, Victim, choose_victims, evaluate, result_named
from stablewatch.detector.evaluation.victims import sink_components
from stablewatch.detector.evaluation.waitfor import Node, wait_nodes
from stablewatch.v1 import (
    WAIT_MODEL_AND,
    WAIT_MODEL_OR,
    AckPosition,
    ChannelSnapshot,
    GlobalSnapshot,
    LocalState,
    ProcessSnapshot,
    RecordedMessage,
    Wait,
    WaitModel,
    WaitNode,
)
from stablewatch.v1.state_pb2 import WAIT_MODEL_UNSPECIFIED

Pair = tuple[str, int]  # (process, wait instance)


def node(text: str) -> WaitNode:
    process, _, task = text.partition("/")
    return WaitNode(process=process, task=task)


def wait(
    targets: str,
    task: str = "",
    *,
    instance: int,
    began: int = 0,
    model: WaitModel = WAIT_MODEL_AND,
    flow_control: bool = False,
) -> Wait:
    return Wait(
        task=task,
        targets=[node(t) for t in targets.split()],
        model=model,
        instance=instance,
        began_at_us=began,
        flow_control=flow_control,
    )


def proc(pid: str, *waits: Wait, active: bool = False) -> ProcessSnapshot:
    return ProcessSnapshot(process_id=pid, state=LocalState(active=active, waits=waits))


def snapshot(*processes: ProcessSnapshot, channels: tuple[ChannelSnapshot, ...] = ()) -> GlobalSnapshot:
    return GlobalSnapshot(snapshot_id=9, processes=processes, channels=channels)


def victims(s: GlobalSnapshot, policy: str = "youngest", exclude: Container[Pair] = ()) -> list[Victim]:
    """Through the real path: the evaluation's wait-for graph, as the detector stores it."""
    return choose_victims(s, evaluate(s).wait_for, policy, exclude)


def proves_deadlock(s: GlobalSnapshot) -> bool:
    result = result_named(evaluate(s), "deadlock")
    return result is not None and result.holds and not result.unknown


def chosen(s: GlobalSnapshot, policy: str = "youngest", exclude: Container[Pair] = ()) -> list[Pair]:
    return [(v.process, v.instance) for v in victims(s, policy, exclude)]


def two_cycle(a_began: int = 100, b_began: int = 200) -> GlobalSnapshot:
    return snapshot(
        proc("A", wait("B/t2", "t1", instance=1, began=a_began)),
        proc("B", wait("A/t1", "t2", instance=5, began=b_began)),
    )


# --- wait_nodes: the one mapping from a wait to its node ---------------------------------------


def test_wait_nodes_merge_a_tasks_and_waits_and_split_mixed_ones() -> None:
    p = proc(
        "P",
        wait("A", "t", instance=1),
        wait("B", "u", instance=2, model=WAIT_MODEL_OR),
        wait("C", "t", instance=3, model=WAIT_MODEL_UNSPECIFIED),
        wait("D", "u", instance=4),
        wait("E", "", instance=5),
    )
    assert [(w.instance, n) for w, n in wait_nodes(p)] == [
        (1, ("P", "t")),
        (2, ("P", "u[wait 1]")),
        (3, ("P", "t")),
        (4, ("P", "u[wait 2]")),
        (5, ("P", "")),
    ]


# --- the choice ---------------------------------------------------------------------------------


def test_a_two_cycle_of_and_waits_gets_one_victim_with_its_deadlock() -> None:
    [victim] = victims(two_cycle())
    assert victim == Victim(
        process="B",
        task="t2",
        instance=5,
        began_at_us=200,
        node=("B", "t2"),
        component=(("A", "t1"), ("B", "t2")),
        deadlock_text="A/t1 -> B/t2 -> A/t1",
    )
    assert victim.key == (("A", "t1"), ("B", "t2"))


def test_youngest_breaks_the_latest_wait_and_oldest_the_earliest() -> None:
    assert chosen(two_cycle(100, 200), "youngest") == [("B", 5)]
    assert chosen(two_cycle(100, 200), "oldest") == [("A", 1)]
    assert chosen(two_cycle(300, 200), "youngest") == [("A", 1)]
    assert chosen(two_cycle(300, 200), "oldest") == [("B", 5)]


def test_ties_go_to_the_smallest_process_then_instance() -> None:
    assert chosen(two_cycle(100, 100), "youngest") == [("A", 1)]
    assert chosen(two_cycle(100, 100), "oldest") == [("A", 1)]
    s = snapshot(
        proc("B", wait("A", instance=2, began=50)),
        proc("A", wait("B", instance=9, began=70), wait("B", instance=4, began=70)),
    )
    assert chosen(s, "youngest") == [("A", 4)]
    assert chosen(s, "oldest") == [("B", 2)]


def test_an_unknown_start_comes_last_in_either_order() -> None:
    s = snapshot(proc("A", wait("B", instance=1, began=0)), proc("B", wait("A", instance=2, began=10)))
    assert chosen(s, "youngest") == chosen(s, "oldest") == [("B", 2)]


def test_a_chain_into_a_cycle_is_never_the_victim() -> None:
    s = snapshot(
        proc("C", wait("D/x", "x", instance=1, began=900)),
        proc("D", wait("A/t1", "x", instance=1, began=999)),
        *two_cycle().processes,
    )
    evaluation = evaluate(s)
    assert {(n.process, n.task) for n in evaluation.wait_for.deadlock.deadlocked} >= {("C", "x"), ("D", "x")}
    assert chosen(s, "youngest") == [("B", 5)]
    assert chosen(s, "oldest") == [("A", 1)]


def test_two_separate_deadlocks_get_one_victim_each() -> None:
    s = snapshot(
        proc("D", wait("C", instance=3, began=5)),
        proc("C", wait("D", instance=1, began=6)),
        *two_cycle().processes,
    )
    found = victims(s)
    assert [(v.process, v.instance) for v in found] == [("B", 5), ("C", 1)]
    assert [v.key for v in found] == [(("A", "t1"), ("B", "t2")), (("C", ""), ("D", ""))]
    assert found[1].deadlock_text == "C -> D -> C"


def test_an_or_knot_gets_one_victim() -> None:
    s = snapshot(
        proc("A", wait("B C", instance=1, began=10, model=WAIT_MODEL_OR)),
        proc("B", wait("A C", instance=2, began=30, model=WAIT_MODEL_OR)),
        proc("C", wait("A", instance=3, began=20)),
    )
    evaluation = evaluate(s)
    assert len(evaluation.wait_for.deadlock.knot) == 3
    [victim] = victims(s)
    assert (victim.process, victim.instance) == ("B", 2)
    assert victim.component == (("A", ""), ("B", ""), ("C", ""))
    assert victim.deadlock_text == "A -> B -> A"
    # One target free is enough for an OR wait: no deadlock, nothing to break.
    free = snapshot(proc("A", wait("B Z", instance=1, model=WAIT_MODEL_OR)), proc("B", wait("A", instance=2)))
    assert victims(free) == []


def test_instance_zero_is_never_chosen() -> None:
    s = snapshot(proc("A", wait("B", instance=0, began=999)), proc("B", wait("A", instance=4, began=1)))
    assert chosen(s, "youngest") == [("B", 4)]
    older = snapshot(proc("A", wait("B", instance=0)), proc("B", wait("A", instance=0)))
    assert proves_deadlock(older)
    assert victims(older) == []


def test_exclude_skips_to_the_next_candidate() -> None:
    assert chosen(two_cycle(), "youngest", exclude={("B", 5)}) == [("A", 1)]
    assert chosen(two_cycle(), "youngest", exclude={("B", 1)}) == [("B", 5)]  # other process, same number


def test_a_deadlock_whose_only_candidate_is_excluded_gets_no_victim() -> None:
    s = snapshot(
        proc("A", wait("B/t2", "t1", instance=1, began=100)),
        proc("B", wait("A/t1", "t2", instance=0, began=200)),
        proc("C", wait("D", instance=1)),
        proc("D", wait("C", instance=2)),
    )
    assert chosen(s, exclude={("A", 1)}) == [("C", 1)]
    assert chosen(s, exclude={("A", 1), ("C", 1), ("D", 2)}) == []


def test_an_unknown_policy_is_refused_naming_the_allowed_ones() -> None:
    with pytest.raises(ValueError, match="youngest, oldest"):
        victims(two_cycle(), "random")
    with pytest.raises(ValueError, match="'newest'"):
        choose_victims(snapshot(), evaluate(snapshot()).wait_for, "newest")


def test_no_deadlock_no_victim() -> None:
    assert victims(snapshot()) == []
    assert victims(snapshot(proc("A", wait("B", instance=1)), proc("B"))) == []
    # A cycle whose edge a message in flight satisfies is no deadlock.
    reply = ChannelSnapshot(src="B", dst="A", sent_before_marker=1, messages=[RecordedMessage(payload=b"r")])
    s = snapshot(proc("A", wait("B", instance=1)), proc("B", wait("A", instance=2)), channels=(reply,))
    assert victims(s) == []


def test_a_wait_that_only_waits_outside_the_component_is_not_a_candidate() -> None:
    # A/t's two AND waits merge into one node; the youngest waits on a process outside the cut.
    s = snapshot(
        proc("A", wait("B/t", "t", instance=1, began=10), wait("OUT", "t", instance=2, began=50)),
        proc("B", wait("A/t", "t", instance=3, began=20)),
    )
    assert chosen(s) == [("B", 3)]
    assert chosen(s, "oldest") == [("A", 1)]


def test_split_waits_are_chosen_by_their_own_node() -> None:
    # (B/t or a free node) and (B/t): only the second wait holds A/t up.
    s = snapshot(
        proc(
            "A",
            wait("B/t C/free", "t", instance=1, began=90, model=WAIT_MODEL_OR),
            wait("B/t", "t", instance=2, began=80),
        ),
        proc("B", wait("A/t", "t", instance=3, began=20)),
        proc("C"),
    )
    [victim] = victims(s)
    assert (victim.process, victim.task, victim.instance, victim.node) == ("A", "t", 2, ("A", "t[wait 2]"))
    assert victim.component == (("A", "t"), ("A", "t[wait 2]"), ("B", "t"))


def test_a_flow_control_wait_met_by_an_acknowledgement_is_not_a_candidate() -> None:
    # A/t waits on B twice: a plain wait, and a blocked send whose window space is on its way back.
    acked = ChannelSnapshot(
        src="A",
        dst="B",
        receiver_acked=AckPosition(sender_incarnation=1, receiver_incarnation=1, next_seq=5),
        sender_ack_seen=AckPosition(sender_incarnation=1, receiver_incarnation=1, next_seq=3),
    )
    s = snapshot(
        proc("A", wait("B", "t", instance=1, began=10), wait("B", "t", instance=2, began=99, flow_control=True)),
        proc("B", wait("A/t", instance=3, began=20)),
        channels=(acked,),
    )
    assert chosen(s) == [("B", 3)]
    unacked = snapshot(*s.processes)
    assert chosen(unacked) == [("A", 2)]


def test_the_choice_does_not_depend_on_the_order_of_processes_or_waits() -> None:
    processes = [
        proc("A", wait("B/t", "t", instance=1, began=5), wait("C", "t", instance=2, began=5)),
        proc("B", wait("A/t", "t", instance=1, began=5), wait("C", "t", instance=2, began=5)),
        proc("C", wait("A/t", instance=7, began=5)),
    ]
    expected = victims(snapshot(*processes))
    assert [(v.process, v.instance) for v in expected] == [("A", 1)]
    rng = random.Random(25)
    for _ in range(10):
        rng.shuffle(processes)
        for p in processes:
            waits = list(p.state.waits)
            rng.shuffle(waits)
            del p.state.waits[:]
            p.state.waits.extend(waits)
        assert victims(snapshot(*processes)) == expected


def test_a_long_cycle_is_cut_short_in_the_text() -> None:
    names = [f"P{i}" for i in range(9)]
    s = snapshot(*(proc(p, wait(names[(i + 1) % 9], instance=1, began=i)) for i, p in enumerate(names)))
    [victim] = victims(s)
    assert (victim.process, victim.instance) == ("P8", 1)
    assert victim.deadlock_text == "P0 -> P1 -> P2 -> P3 -> P4 -> ... (4 more) -> P0"


# --- property: the same victim on every cut of a deadlocked system ------------------------------

OUTSIDE = ["OUT", "OUT/x"]  # a process never in a snapshot: its nodes are free
MODELS = st.sampled_from([WAIT_MODEL_AND, WAIT_MODEL_OR, WAIT_MODEL_UNSPECIFIED])
BEGAN = st.integers(0, 6).map(lambda t: t * 1000)  # few distinct times: ties and unknown starts


@dataclass(frozen=True)
class Core:
    """The deadlocked part of a system: what every cut that shows the deadlock records alike."""

    waits: dict[str, list[Wait]]  # process -> its deadlocked tasks' waits, in order
    cycles: list[list[Node]]  # each deadlock's tasks; its waits target only these (and OUTSIDE)
    # Deadlocked cycles that are no sink: they wait on a deadlock too, so breaking them ends nothing.
    feeders: list[list[Node]]

    def nodes(self) -> list[Node]:
        return [n for cycle in self.cycles + self.feeders for n in cycle]

    def tasks(self, process: str) -> set[str]:
        return {task for p, task in self.nodes() if p == process}

    def target_processes(self, process: str, task: str | None = None, *, flow_control: bool = False) -> set[str]:
        """Processes the waits of `process` (of `task`, or any) wait on (only flow-control ones)."""
        return {
            t.process
            for w in self.waits.get(process, [])
            if (task is None or w.task == task) and (w.flow_control or not flow_control)
            for t in w.targets
        }


def text(n: Node) -> str:
    return f"{n[0]}/{n[1]}" if n[1] else n[0]


@st.composite
def cores(draw: st.DrawFn) -> Core:
    """Deadlocks that stay put: 1-3 disjoint cycles of tasks, each task's waits (AND, OR, several of
    them, flow-control or not) on members of its own cycle, extra waits also on free nodes."""
    processes = [f"P{i}" for i in range(draw(st.integers(1, 4)))]
    instance = {p: 0 for p in processes}
    waits: dict[str, list[Wait]] = {p: [] for p in processes}
    cycles: list[list[Node]] = []
    taken: set[Node] = set()

    def new_wait(p: str, task: str, targets: list[str], *, primary: bool) -> Wait:
        instance[p] += draw(st.integers(1, 3))
        zero = not primary and draw(st.integers(0, 7)) == 0  # an older agent's wait: no id
        model = draw(MODELS)
        return Wait(
            task=task,
            targets=[node(t) for t in targets],
            model=model,
            instance=0 if zero else instance[p],
            began_at_us=draw(BEGAN),
            flow_control=draw(st.booleans()),
        )

    for c in range(draw(st.integers(1, 3))):
        cycle: list[Node] = []
        for i in range(draw(st.integers(1, 4))):
            p = draw(st.sampled_from(processes))
            itself = (p, "") not in taken and draw(st.integers(0, 3)) == 0  # the process's own wait
            cycle.append((p, "") if itself else (p, f"c{c}t{i}"))
            taken.add(cycle[-1])
        cycles.append(cycle)
        members = [text(n) for n in cycle]
        for i, (p, task) in enumerate(cycle):
            # The primary wait keeps the cycle closed: on the next member, and maybe on more of them.
            targets = [members[(i + 1) % len(members)], *draw(st.lists(st.sampled_from(members), max_size=2))]
            group = [new_wait(p, task, targets, primary=True)]
            for _ in range(draw(st.integers(0, 2))):
                extra = draw(st.lists(st.sampled_from(members + OUTSIDE), min_size=1, max_size=3))
                group.append(new_wait(p, task, extra, primary=False))
            waits[p].extend(draw(st.permutations(group)))
    feeders: list[list[Node]] = []
    for c in range(draw(st.integers(0, 2))):
        cycle = [(draw(st.sampled_from(processes)), f"f{c}t{i}") for i in range(draw(st.integers(1, 3)))]
        members = [text(n) for n in cycle]
        sinks = [text(n) for earlier in cycles + feeders for n in earlier]
        for i, (p, task) in enumerate(cycle):
            # AND waits only, on the next member; the first also on an earlier deadlock.
            targets = [members[(i + 1) % len(members)]]
            group = [targets, [draw(st.sampled_from(sinks))]] if i == 0 else [targets]
            for targets in draw(st.permutations(group)):
                instance[p] += 1
                waits[p].append(
                    Wait(task=task, targets=[node(t) for t in targets], instance=instance[p], began_at_us=draw(BEGAN))
                )
        feeders.append(cycle)
    # A blocked send waits on its receiver's handler, which is free unless the receiver records a
    # wait of its own (task "": waitfor.consuming): a deadlocked one targets only such receivers.
    own = {p for p, group in waits.items() if any(not w.task and w.targets for w in group)}
    for group in waits.values():
        for w in group:
            if w.flow_control and not all(t.process in own for t in w.targets):
                w.flow_control = False
    return Core(waits, cycles, feeders)


@st.composite
def cuts(draw: st.DrawFn, core: Core, snapshot_id: int) -> GlobalSnapshot:
    """One consistent cut of a system holding `core`: everything that can still change varies.

    Waiters outside the deadlock (chains into it, waits on free or outside nodes, never a cycle of
    their own) come and go, free processes join, processes are active or not, messages and
    acknowledgements are in flight, and the processes and their waits are listed in any order.
    Nothing in flight releases a deadlocked wait: it is deadlocked.
    """
    core_processes = list(core.waits)
    free = [f"F{i}" for i in range(draw(st.integers(0, 3)))]
    others = [f"N{i}" for i in range(draw(st.integers(0, 3)))]
    processes = core_processes + others + free
    deadlocked = [text(n) for n in core.nodes()]
    noise: dict[str, list[Wait]] = {p: [] for p in processes}
    waiters: list[str] = []
    for j in range(draw(st.integers(0, 6))):
        p = draw(st.sampled_from(core_processes + others))
        # Only on nodes before this one (no new cycle), the deadlock, free and outside nodes.
        pool = deadlocked + waiters + free + OUTSIDE
        for k in range(draw(st.integers(1, 2))):
            noise[p].append(
                Wait(
                    task=f"n{j}",
                    targets=[node(t) for t in draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3))],
                    model=draw(MODELS),
                    instance=10_000 + 10 * j + k,
                    began_at_us=draw(st.integers(0, 9_000)),
                    flow_control=draw(st.booleans()),
                )
            )
        waiters.append(f"{p}/n{j}")

    listed = []
    for p in draw(st.permutations(processes)):
        mine, theirs = core.waits.get(p, []), noise[p]
        # Interleave the noise anywhere; a deadlocked task's own waits keep their order (an agent
        # lists a wait's instances as they began, and ``task[wait k]`` counts in that order).
        slots = draw(st.permutations([True] * len(mine) + [False] * len(theirs)))
        in_order, others_left = iter(mine), iter(theirs)
        waits = [next(in_order) if is_core else next(others_left) for is_core in slots]
        listed.append(ProcessSnapshot(process_id=p, state=LocalState(active=draw(st.booleans()), waits=waits)))

    channels = []
    pairs = [(s, d) for s in processes for d in processes if s != d]
    busy = draw(st.lists(st.sampled_from(pairs), unique=True, max_size=8)) if pairs else []
    for src, dst in busy:
        tasks = sorted(core.tasks(dst)) + sorted({w.task for w in noise[dst]})
        messages = []
        for _ in range(draw(st.integers(0, 2))):
            wakes = draw(st.sampled_from(["", "", "other", *tasks]))
            # A waking message from src may release dst's waits on src; never a deadlocked one.
            holds = any(src in core.target_processes(dst, t) for t in core.tasks(dst) if wakes in ("", t))
            messages.append(
                RecordedMessage(payload=b"m", wakes_task=wakes, no_wake=holds or draw(st.integers(0, 3)) == 0)
            )
        channel = ChannelSnapshot(src=src, dst=dst, sent_before_marker=len(messages), messages=messages)
        # An acknowledgement on its way back to src releases src's blocked sends to dst: never a deadlocked one.
        if dst not in core.target_processes(src, flow_control=True) and draw(st.booleans()):
            channel.receiver_acked.CopyFrom(AckPosition(sender_incarnation=1, receiver_incarnation=1, next_seq=9))
            channel.sender_ack_seen.CopyFrom(AckPosition(sender_incarnation=1, receiver_incarnation=1, next_seq=4))
        channels.append(channel)
    return GlobalSnapshot(snapshot_id=snapshot_id, processes=listed, channels=channels)


def expected(core: Core, policy: str, exclude: set[Pair]) -> list[Pair]:
    """An independent oracle, per deadlock (by its smallest task): the policy's first wait with an
    id, not excluded, of one of its tasks, on one of them and not released."""
    found = []
    for cycle in sorted(core.cycles, key=min):
        members = set(cycle)
        candidates = [
            (p, w)
            for p, group in core.waits.items()
            for w in group
            if (p, w.task) in members
            and w.instance
            and (p, w.instance) not in exclude
            and any((t.process, t.task) in members for t in w.targets)
            # An OR wait with a free target is released (its task's other waits hold it).
            and (w.model != WAIT_MODEL_OR or all((t.process, t.task) in members for t in w.targets))
        ]
        sign = -1 if policy == "youngest" else 1
        if candidates:
            p, w = min(candidates, key=lambda c: (c[1].began_at_us == 0, sign * c[1].began_at_us, c[0], c[1].instance))
            found.append((p, w.instance))
    return found


@settings(max_examples=120, deadline=None, derandomize=True)
@given(st.data())
def test_the_same_victim_on_every_cut_that_shows_the_deadlock(data: st.DataObject) -> None:
    core = data.draw(cores(), label="core")
    snapshots = [data.draw(cuts(core, i + 1), label=f"cut {i + 1}") for i in range(data.draw(st.integers(2, 5)))]
    graphs = []
    for s in snapshots:
        assert proves_deadlock(s)
        graphs.append(evaluate(s).wait_for)
    for policy in POLICIES:
        first: list[Victim] = []
        for s, graph in zip(snapshots, graphs, strict=True):
            components = sink_components(graph)
            found = choose_victims(s, graph, policy)
            # One victim per sink component, and the sink components are exactly the deadlocks.
            assert len(components) == len(found) == len(core.cycles)
            assert [v.key for v in found] == [tuple(c) for c in components]
            assert [(v.process, v.instance) for v in found] == expected(core, policy, set())
            for victim in found:
                [cycle] = [c for c in core.cycles if set(c) <= set(victim.component)]
                assert {n for n in victim.component if "[wait " not in n[1]} == set(cycle)
                # Never a wait outside the component: its node is in it, and it waits on a member.
                [(w, n)] = [
                    (w, n)
                    for p in s.processes
                    if p.process_id == victim.process
                    for w, n in wait_nodes(p)
                    if w.instance == victim.instance
                ]
                assert n == victim.node and n in victim.component
                assert any((t.process, t.task) in victim.component for t in w.targets)
            first = first or found
            assert found == first
        # After those breaks, the next victims are just as much the same on every cut.
        broken = {(v.process, v.instance) for v in first}
        after = [choose_victims(s, graph, policy, exclude=broken) for s, graph in zip(snapshots, graphs, strict=True)]
        assert all(a == after[0] for a in after)
        assert [(v.process, v.instance) for v in after[0]] == expected(core, policy, broken)
