"""Where a layout's messages travel on several nodes, as the planner charges them.

A layout (:class:`.Layout`) on ``N`` nodes puts each pipeline inside one node where its stages divide the processes
per node (ranks replica-major), else ranks stay stage-major. :func:`replica_view` gives :func:`.planner.simulate`
the space as one replica's pipeline sees it there:

* stage-to-stage messages (activations, gradients): the spec's ``message_ms`` is measured on one host, so it is
  the intra-node cost; a pipeline that crosses nodes pays the inter-node link's latency over the intra-node one's
  on every message (the spec has no activation sizes, so no bandwidth term);
* the replicas' streamed reduction (:func:`.links.streamed_chain_ms`) takes the inter-node link on every hop
  between nodes: replica-major, a stage's replicas on one node are ``per_node / S`` neighbours of the chain.
"""

from __future__ import annotations

from dataclasses import replace

from lightning_naspipe.pipeline.placement.layout import Layout
from lightning_naspipe.planning.links import LINKS, LinkModel
from lightning_naspipe.planning.space_spec import SpaceSpec

__all__ = ["DEFAULT_LINKS", "replica_view"]

#: The links :func:`replica_view` assumes on several nodes when neither the call nor the spec names any.
DEFAULT_LINKS = "nvlink + ib400"


def replica_view(spec: SpaceSpec, stages: int, replicas: int, links: LinkModel | None = None,
                 nodes: int | None = None) -> SpaceSpec:
    """The space as one replica of ``replicas`` sees it on ``nodes`` nodes.

    Each candidate's compute is the replica's share of the batch; each subnet's update on a stage waits for the
    streamed reduction of its gradients there, and each window for the gather of the last stage's losses.

    Args:
        spec: the space's costs, messages as measured on one host.
        stages: pipeline stages.
        replicas: data-parallel replicas of each stage.
        links: the cluster's links; default: the spec's ``replica_links``, and on several nodes
            :data:`DEFAULT_LINKS` where the spec has none.
        nodes: nodes the ``stages * replicas`` processes span (``None``: as the link model's ``per_node`` has it).

    Raises:
        ValueError: ``nodes`` does not divide the processes.
    """
    if replicas > 1:
        spec = replace(spec.compute_scaled(lambda ms: ms / replicas), reduce_hops=2.0 * (replicas - 1),
                       sync_ms=spec.sync_ms + spec.message_ms + spec.message_cpu_ms,
                       replica_links=links or spec.replica_links)
    if nodes is None:
        return spec
    if nodes < 1 or stages * replicas % nodes:
        raise ValueError(f"nodes={nodes} must divide the {stages * replicas} processes ({stages} stages x {replicas} "
                         "replicas): every node runs as many; choose a process count that is a multiple of it")
    model = links or spec.replica_links
    if nodes > 1 and (model is None or model.per_node >= 1 << 30):  # none, or one host's uniform model
        model = LINKS[DEFAULT_LINKS]
    if model is None:
        return spec
    layout = Layout(stages, replicas, nodes)
    # Replica-major, the chain of a stage's replicas steps S ranks at a time: per_node / S of them share a node.
    per_node = layout.per_node // stages if layout.replica_major else layout.per_node
    crossing = 0.0 if layout.pipelines_in_nodes else max(0.0, model.inter.ms(0) - model.intra.ms(0))
    return replace(spec, message_ms=spec.message_ms + crossing, replica_links=replace(model, per_node=per_node))
