"""NCCL's ordering rules as a model checker, and the weight sync's collective schedule as a model,
for layouts too big to run here (the shipped 256-GPU ones).

The checker runs one list of operations per rank under NCCL's semantics, which are stricter than
gloo's: a collective completes only when every member of its communicator has reached it, in the
same order on every member (a different operation at the same position is a mismatch); a send
completes only when its receiver has posted the matching receive (rendezvous), and every later
operation of the sender waits behind it. When no rank can move and some have operations left, the
schedule deadlocks, and the report names every stuck rank and what it waits in.

The schedule model is the round protocol of `slimrl/trainer/weight_sync.py` and
`slimrl/weight_sync/transports.py`: per round, every rank gathers its unit's sharded tensors over
its tensor-parallel and expert-tensor-parallel groups (the counts are abstracted: every member of
such a group has the same units, so they repeat identically), then the exchange. The exchange part
is checked against traces of real runs in `tests/test_weight_sync_order.py`.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass

from slimrl.devices.rank_groups import Sizes, decoder_groups, expert_groups


@dataclass(frozen=True, slots=True)
class Op:
    kind: str
    """"coll", "send" or "recv"."""
    name: str
    """What it is (all_gather, broadcast, ...); collectives at one position must agree on it."""
    members: tuple[int, ...]
    """Collective: the communicator's ranks. Send/recv: (peer,)."""
    label: str = ""


class Deadlock(AssertionError):
    pass


def describe(rank: int, op: Op) -> str:
    if op.kind == "coll":
        return f"rank {rank} waits in {op.name} on {op.label or list(op.members)}"
    direction = "to" if op.kind == "send" else "from"
    return f"rank {rank} waits in {op.kind} {direction} rank {op.members[0]}"


def check(schedule: list[list[Op]]) -> int:
    """Run the schedule under NCCL's rules; returns the operations completed, or raises Deadlock."""
    n = len(schedule)
    pos = [0] * n
    gids: dict[tuple[int, ...], int] = {}
    by_id: dict[int, int] = {}  # the model shares one tuple per group: hash each once

    def gid(members: tuple[int, ...]) -> int:
        found = by_id.get(id(members))
        if found is None:
            found = by_id[id(members)] = gids.setdefault(members, len(gids))
        return found

    done_on: list[dict[int, int]] = [defaultdict(int) for _ in range(n)]
    arrived: dict[tuple[int, int], list] = {}  # (group, k) -> [count, first op]
    waiting = [False] * n
    queue = deque(range(n))
    completed = 0
    while queue:
        r = queue.popleft()
        if pos[r] >= len(schedule[r]) or waiting[r]:
            continue
        op = schedule[r][pos[r]]
        if op.kind == "coll":
            g = gid(op.members)
            key = (g, done_on[r][g])
            entry = arrived.setdefault(key, [0, op])
            first = entry[1]
            if (first.name, first.label) != (op.name, op.label):
                raise Deadlock(
                    f"collective order mismatch on {op.label or list(op.members)}: {describe(r, op)}, "
                    f"another member in {first.name}"
                )
            entry[0] += 1
            waiting[r] = True
            if entry[0] == len(op.members):
                del arrived[key]
                for m in op.members:
                    done_on[m][g] += 1
                    pos[m] += 1
                    waiting[m] = False
                    queue.append(m)
                completed += 1
            continue
        peer = op.members[0]
        if pos[peer] >= len(schedule[peer]):
            continue
        theirs = schedule[peer][pos[peer]]
        wanted = "recv" if op.kind == "send" else "send"
        if theirs.kind == wanted and theirs.members[0] == r:
            pos[r] += 1
            pos[peer] += 1
            waiting[peer] = False
            queue.extend((r, peer))
            completed += 1
    stuck = [describe(r, schedule[r][pos[r]]) for r in range(n) if pos[r] < len(schedule[r])]
    if stuck:
        more = f" (+{len(stuck) - 8} more)" if len(stuck) > 8 else ""
        raise Deadlock(f"deadlock: {'; '.join(stuck[:8])}{more}")
    return completed


# ----------------------------------------------------------------------------- the schedule model


@dataclass(frozen=True)
class Unit:
    """One export unit of a rank: whether it holds dense TP-sharded tensors, and MoE experts."""

    dense: bool
    moe: bool


def rank_units(
    stage_layers: list[list[int]], moe_layers: set[int], pp_rank: int, pp: int, vpp: int
) -> list[Unit]:
    """A pipeline rank's units in export order: per virtual stage, the embedding (first), each
    layer, the final norm and output layer (last)."""
    units = []
    for vp in range(vpp):
        stage = vp * pp + pp_rank
        if stage == 0:
            units.append(Unit(dense=True, moe=False))
        units += [Unit(dense=True, moe=layer in moe_layers) for layer in stage_layers[stage]]
        if stage == pp * vpp - 1:
            units.append(Unit(dense=True, moe=False))
    return units


def _coords(s: Sizes) -> dict[str, list[int]]:
    """Per rank: its rank within each dimension that decides ownership and groups."""
    out: dict[str, list[int]] = {k: [0] * s.world for k in ("tp", "dp", "pp", "etp", "edp")}
    for dims, key, groups in (
        (("tp",), "tp", decoder_groups(s, ("tp",))),
        (("cp", "dp"), "dp", decoder_groups(s, ("cp", "dp"))),
        (("pp",), "pp", decoder_groups(s, ("pp",))),
        (("tp",), "etp", expert_groups(s, ("tp",))),
        (("dp",), "edp", expert_groups(s, ("dp",))),
    ):
        del dims
        for group in groups:
            for index, rank in enumerate(group):
                out[key][rank] = index
    return out


def sync_schedule(
    s: Sizes,
    stage_layers: list[list[int]],
    moe_layers: set[int],
    transport: str,
    senders: list[list[int]],
    vpp: int = 1,
) -> list[list[Op]]:
    """Every rank's operations for one weight sync (one bucket per owner and round)."""
    world = s.world
    coords = _coords(s)
    tp_of = {r: t for g in decoder_groups(s, ("tp",)) for t in [tuple(g)] for r in g}
    etp_of = {r: t for g in expert_groups(s, ("tp",)) for t in [tuple(g)] for r in g}
    everyone = tuple(range(world))
    units = [rank_units(stage_layers, moe_layers, coords["pp"][r], s.pp, vpp) for r in range(world)]
    rounds = max(len(u) for u in units)
    start = [
        Op("coll", "barrier", everyone, "trainer_world"),
        Op("coll", "all_reduce", everyone, "trainer_world"),
    ]
    sched: list[list[Op]] = [list(start) for _ in range(world)]
    engine_groups = {i: tuple(sorted(set(ss))) for i, ss in enumerate(senders) if len(set(ss)) > 1}
    for k in range(rounds):
        owners = []
        for r in range(world):
            unit = units[r][k] if k < len(units[r]) else None
            owns = False
            if unit is not None:
                if s.tp > 1:
                    sched[r].append(Op("coll", "all_gather", tp_of[r], "tensor_parallel"))
                owns = coords["tp"][r] == 0 and coords["dp"][r] == 0
                if unit.moe:
                    if s.etp > 1:
                        sched[r].append(Op("coll", "all_gather", etp_of[r], "expert_tensor_parallel"))
                    owns = owns or (coords["etp"][r] == 0 and coords["edp"][r] == 0)
            if owns:
                owners.append(r)
        for r in range(world):
            if transport == "tensor":
                sched[r].append(Op("coll", "all_gather_object", everyone, "trainer_world"))
                for owner in owners:
                    sched[r].append(Op("coll", "broadcast", everyone, "trainer_world"))
                    for index, members in engine_groups.items():
                        if r in members:
                            sched[r].append(Op("coll", "gather_object", members, f"engine {index}"))
                            sched[r].append(Op("coll", "barrier", members, f"engine {index}"))
                    del owner
            elif transport == "distributed":
                sched[r].append(Op("coll", "gather_object", everyone, "trainer_world"))
                if r == 0:
                    sched[r] += [Op("recv", "recv", (o,)) for o in owners if o != 0]
                elif r in owners:
                    sched[r].append(Op("send", "send", (0,)))
    for r in range(world):
        sched[r].append(Op("coll", "barrier", everyone, "trainer_world"))
    return sched


def old_funnel_schedule(s: Sizes, stage_layers: list[list[int]], moe_layers: set[int]) -> list[list[Op]]:
    """The funnel the rounds replaced: owners send each filled bucket to rank 0 during the export
    (a bucket per owned unit), rank 0 receives them only after its own export."""
    world = s.world
    coords = _coords(s)
    tp_of = {r: t for g in decoder_groups(s, ("tp",)) for t in [tuple(g)] for r in g}
    sched: list[list[Op]] = [[] for _ in range(world)]
    pending: dict[int, int] = defaultdict(int)
    for r in range(world):
        for unit in rank_units(stage_layers, moe_layers, coords["pp"][r], s.pp, 1):
            if s.tp > 1:
                sched[r].append(Op("coll", "all_gather", tp_of[r], "tensor_parallel"))
            owns = coords["tp"][r] == 0 and coords["dp"][r] == 0
            owns = owns or (unit.moe and coords["etp"][r] == 0 and coords["edp"][r] == 0)
            if owns and r != 0:
                sched[r].append(Op("send", "send", (0,)))
                pending[r] += 1
    for source in range(1, world):
        sched[0] += [Op("recv", "recv", (source,)) for _ in range(pending[source])]
    return sched
