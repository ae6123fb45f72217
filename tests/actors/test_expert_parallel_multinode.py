"""Expert parallelism across nodes of a real multi-node Ray cluster (ray.cluster_utils.Cluster)."""

from __future__ import annotations

import numpy as np
import pytest

from actors.target.checkpoint import load_model
from actors.target.decode import greedy_decode
from actors.target.driver import DriverGroup
from actors.target.group import EPConfig, EPGroup
from actors.target.local import LocalTarget

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9], [10, 11, 12], [40, 41, 42, 43]]


@pytest.fixture(scope="module")
def cluster(multinode):
    yield from multinode(head_cpus=1, worker_cpus=[2, 2])


@pytest.mark.parametrize("group_kind", [EPGroup, DriverGroup])
def test_ep_ranks_on_distinct_nodes_match_one_process(cluster, tiny_checkpoint, group_kind):
    model = load_model(tiny_checkpoint)
    ref = LocalTarget(model).forward(list(range(4)), PROMPTS, with_logits=True)
    ref_greedy = greedy_decode(LocalTarget(model), list(range(4)), PROMPTS, max_new_tokens=10)
    group = group_kind(EPConfig(tiny_checkpoint, world=2, placement="STRICT_SPREAD"))
    try:
        nodes = {r["node"] for r in group.ranks}
        assert len(nodes) == 2  # STRICT_SPREAD: one rank per node
        out = group.forward(list(range(4)), PROMPTS, with_logits=True)
        np.testing.assert_allclose(out.logits, ref.logits, rtol=1e-5, atol=1e-5)
        assert greedy_decode(group, [10, 11, 12, 13], PROMPTS, max_new_tokens=10) == ref_greedy
    finally:
        group.shutdown()
