"""A distributed job that terminates: workers process tasks that spawn subtasks, until none is left.

What it demonstrates: the ``termination`` predicate (every process passive, no waking message in
flight), which must never hold before the job is really done.

The job. The first worker of ``--workers`` seeds ``--tasks`` root tasks, dealt round-robin over
the workers. Processing a task takes a few milliseconds (up to ``--work-ms``) and spawns 0–2
subtasks, each sent to a random worker, with a budget one lower than its parent's (roots start
at ``--depth``; a task with budget 0 spawns nothing), so the job is finite. Every choice comes
from a generator seeded by ``--seed`` and the task's id, so the tree of tasks, hence its size
(:func:`total_tasks`), depends on the seed only and not on timing.

A worker is active exactly while it has queued or running tasks, and passive otherwise
(``LocalStateKeeper.set_active``). The contract says a message is received when the handler
returns, so the handler that queues a task also sets the worker active, in the same step; a
worker goes passive only when its queue is empty, with nothing in between. When the whole job is
done, every worker is passive and no task is in flight: termination, and it stays so.

Progress is in attributes, not counters (the detector checks every counter for conservation and
these only grow): ``created`` (tasks this worker created: roots or subtasks), ``done`` (tasks it
processed) and ``queued``. :func:`all_tasks_done` is a user predicate over them, for the detector
(``stablewatch.examples.job:all_tasks_done``): once the job terminated, done equals created.

Each worker logs when it runs out of work. Run three workers against a detector::

    for w in W1 W2 W3; do
        python -m stablewatch.examples.job --id $w --workers W1,W2,W3 --tasks 20 \\
            --peers-dir /tmp/job --detector HOST:PORT &
    done
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import sys
from collections import deque
from collections.abc import Sequence

from stablewatch.agents import Agent, AppMessage
from stablewatch.examples._common import PeerDirectory, id_list, run_service, service_parser
from stablewatch.v1 import GlobalSnapshot

__all__ = ["Worker", "all_tasks_done", "main", "plan", "roots", "total_tasks"]

log = logging.getLogger("stablewatch.examples.job")

Task = tuple[str, int]  # (task id, budget of its subtasks)


def roots(tasks: int, depth: int, workers: Sequence[str]) -> list[tuple[str, int, str]]:
    """The root tasks as ``(task id, budget, worker)``, dealt round-robin starting with the seeder."""
    return [(f"t{i}", depth, workers[i % len(workers)]) for i in range(tasks)]


def plan(seed: int, task: Task, workers: Sequence[str], work_ms: float) -> tuple[float, list[tuple[str, int, str]]]:
    """How long `task` takes (seconds) and its subtasks as ``(task id, budget, worker)``; fixed by seed and id."""
    task_id, budget = task
    rng = random.Random(f"{seed}/{task_id}")
    seconds = rng.uniform(work_ms / 2, work_ms) / 1000
    count = rng.randint(0, 2) if budget > 0 else 0
    return seconds, [(f"{task_id}.{k}", budget - 1, rng.choice(workers)) for k in range(count)]


def total_tasks(seed: int, tasks: int, depth: int, workers: Sequence[str]) -> int:
    """How many tasks the whole job processes (roots and all subtasks): what ``done`` sums to at the end."""
    pending = [(task_id, budget) for task_id, budget, _ in roots(tasks, depth, workers)]
    total = 0
    while pending:
        task = pending.pop()
        total += 1
        _, children = plan(seed, task, workers, 1.0)  # the work time does not change the tree
        pending.extend((child, budget) for child, budget, _ in children)
    return total


def all_tasks_done(snapshot: GlobalSnapshot) -> dict[str, object]:
    """User predicate: every task created so far has been processed (``done`` equals ``created``).

    A claim about the whole job (``whole_system``): unknown on an open cut, whose missing workers'
    tasks are not counted.
    """
    created = sum(int(p.state.attributes["created"]) for p in snapshot.processes if "created" in p.state.attributes)
    done = sum(int(p.state.attributes["done"]) for p in snapshot.processes if "done" in p.state.attributes)
    return {
        "holds": done == created,
        "summary": f"{done} of {created} tasks done",
        "details": {"created": created, "done": done},
        "whole_system": True,
    }


def _encode(task: Task) -> bytes:
    return f"{task[0]}:{task[1]}".encode()


def _decode(payload: bytes) -> Task:
    task_id, budget = payload.decode().rsplit(":", 1)
    return task_id, int(budget)


class Worker:
    """One worker: a queue of tasks processed one at a time; active exactly while it has work."""

    def __init__(self, agent: Agent, args: argparse.Namespace, peers: PeerDirectory) -> None:
        self.agent = agent
        self.peers = peers
        self.workers: list[str] = args.workers
        self.me = agent.process_id
        self.seeder = self.workers[0] == self.me
        self.seed: int = args.seed
        self.tasks: int = args.tasks
        self.depth: int = args.depth
        self.work_ms: float = args.work_ms
        self.queue: deque[Task] = deque()
        self.created = self.done = 0
        self._wakeup = asyncio.Event()
        # A new keeper is active, so no worker looks finished before it has looked at its queue.
        agent.state.set_active(True)
        self._publish()
        agent.on_message(self.on_message)

    def _publish(self) -> None:
        state = self.agent.state
        state.set_attribute("created", self.created)
        state.set_attribute("done", self.done)
        state.set_attribute("queued", len(self.queue))

    def _enqueue(self, task: Task) -> None:
        """Queue `task` and be active, in one step (a snapshot sees both or neither)."""
        self.queue.append(task)
        self.agent.state.set_active(True)
        self._publish()
        self._wakeup.set()

    def on_message(self, src: str, message: AppMessage) -> None:
        """A task arrived: queue it before returning, since it counts as received when this returns."""
        self._enqueue(_decode(message.payload))

    async def _hand_out(self, tasks: list[tuple[str, int, str]]) -> None:
        """Keep each of `tasks` or send it to its worker (the caller has counted them as created)."""
        for task_id, budget, worker in tasks:
            if worker == self.me:
                self._enqueue((task_id, budget))
            else:
                await self.agent.send(worker, _encode((task_id, budget)))

    def _go_idle(self) -> None:
        self.agent.state.set_active(False)
        log.info("no work: idle (processed %d, created %d)", self.done, self.created)

    async def run(self) -> None:
        await self.peers.wait_for_peers(w for w in self.workers if w != self.me)
        if self.seeder:
            log.info("seeding %d tasks (budget %d) over %d workers", self.tasks, self.depth, len(self.workers))
            seeded = roots(self.tasks, self.depth, self.workers)
            self.created += len(seeded)
            self._publish()
            await self._hand_out(seeded)
        while True:
            if not self.queue:
                self._go_idle()  # nothing queued, nothing running: passive until a task arrives
                while not self.queue:
                    self._wakeup.clear()
                    await self._wakeup.wait()
            task = self.queue.popleft()
            self._publish()
            seconds, children = plan(self.seed, task, self.workers, self.work_ms)
            await asyncio.sleep(seconds)
            # One step: this task done and its subtasks created, so done == created means no work is left.
            self.done += 1
            self.created += len(children)
            self._publish()
            await self._hand_out(children)


def main(argv: list[str] | None = None) -> int:
    parser = service_parser("job", "A worker of a distributed job that terminates.")
    parser.add_argument("--workers", type=id_list, required=True, help="every worker id; the first seeds the job")
    parser.add_argument("--tasks", type=int, default=20, help="root tasks the first worker seeds (default 20)")
    parser.add_argument("--depth", type=int, default=4, help="budget of the root tasks: levels of subtasks (default 4)")
    parser.add_argument("--work-ms", type=float, default=20.0, help="most milliseconds one task takes (default 20)")
    args = parser.parse_args(argv)
    if args.id not in args.workers:
        parser.error(f"--id {args.id} is not one of --workers")
    if args.tasks < 0 or args.depth < 0 or args.work_ms < 0:
        parser.error("--tasks, --depth and --work-ms must not be negative")
    return run_service(args, Worker)


if __name__ == "__main__":
    sys.exit(main())
