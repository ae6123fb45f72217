"""One engine unit, one placement group: the bundles it reserves and who sits in which.

Layout: bundle 0 holds the coordinator (under Serve: the engine replica itself) with EP rank 0
and its drafter (the driver rank: they share that process), bundles 1 .. EP-1 hold the other
ranks, each with the drafter replica it hosts. With `in_process=False`, bundle 0 holds the
coordinator alone, bundles 1 .. EP the ranks, the next ones the drafter replica actors. Reserving the whole unit at
once means a unit either starts complete or not at all (no half-started engine holding ranks
while its drafters wait for room), and scaling the engine deployment adds or removes whole units.
Serve creates the group per replica from `bundles()` and captures the replica's child actors
into it; the engine then pins each child to its own bundle with `strategy()`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

COORDINATOR_CPUS = 0.25  # bundle 0: the coordinator's loop (under Serve, the engine replica)


def rank_resources(ep: int, cores: int | None = None) -> tuple[int, float]:
    """Defaults for a unit of `ep` ranks on this machine: torch threads per rank (its share of
    the cores, so ranks do not oversubscribe them) and CPUs each rank's bundle reserves."""
    cores = cores or os.cpu_count() or 1
    return max(1, cores // ep), min(1.0, cores / ep)


@dataclass(frozen=True)
class UnitLayout:
    """Bundles of one engine unit. Driven (`driver`): [coordinator + rank 0 + its drafter, (rank +
    drafter) × (ep - 1)], `drafters` being one per rank or none. Otherwise [coordinator, rank × ep,
    drafter × drafters]."""

    ep: int
    drafters: int
    coordinator_cpus: float = COORDINATOR_CPUS
    cpus_per_rank: float = 1.0
    gpus_per_rank: float = 0.0
    cpus_per_drafter: float = 0.5
    driver: bool = False

    def bundles(self) -> list[dict[str, float]]:
        rank = {"CPU": self.cpus_per_rank} | ({"GPU": self.gpus_per_rank} if self.gpus_per_rank else {})
        if self.driver:
            hosted = self.cpus_per_rank + (self.cpus_per_drafter if self.drafters else 0.0)
            return [rank | {"CPU": self.coordinator_cpus + hosted}] + [rank | {"CPU": hosted}
                                                                       for _ in range(1, self.ep)]
        return [{"CPU": self.coordinator_cpus}] + [dict(rank) for _ in range(self.ep)] + \
            [{"CPU": self.cpus_per_drafter} for _ in range(self.drafters)]

    @property
    def coordinator(self) -> dict[str, float]:
        """What the coordinator's own process reserves (bundle 0)."""
        return self.bundles()[0]

    def rank_bundle(self, rank: int) -> int:
        return rank if self.driver else 1 + rank

    def drafter_bundle(self, replica: int) -> int:
        if self.driver:
            raise ValueError("a driven unit's drafters live in their ranks' processes")
        return 1 + self.ep + replica


def unit_placement_group() -> PlacementGroup:
    """The placement group this process runs in; an error outside one (no silent fallback)."""
    pg = ray.util.get_current_placement_group()
    if pg is None:
        raise RuntimeError("unit placement was asked for, but this engine does not run inside a placement "
                           "group (deploy it with UnitLayout.bundles() as the deployment's bundles)")
    return pg


def in_bundle(pg: PlacementGroup, index: int) -> PlacementGroupSchedulingStrategy:
    """Schedule an actor into one bundle of the unit; its own children stay in the unit too."""
    return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index,
                                            placement_group_capture_child_tasks=True)
