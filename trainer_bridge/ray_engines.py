"""Ray placement: one engine server per GPU (or per tensor-parallel group) as Ray actors in a
placement group, behind one `EnginePool`, as verl and OpenRLHF place their rollout workers.

    with start_engines("path/to/model", num_engines=8, num_gpus_per_engine=1,
                       engine_options={"device": "cuda"}) as engines:
        outputs = engines.pool.generate(prompts, params)

Each actor starts `rollout-engine serve` on its node (`EngineServer`), bound to the node's
address with a per-pool auth token, and keeps it alive; the actor holds the bundle's GPUs,
and the server inherits the actor's `CUDA_VISIBLE_DEVICES`. Needs `pip install ray`.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping
from typing import Any, Literal, Self

from trainer_bridge.engine_pool import EnginePool
from trainer_bridge.server_process import EngineServer

logger = logging.getLogger(__name__)

Strategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]


class EngineServerActor:
    """A Ray actor owning one engine server process on its node."""

    def __init__(self, model: str, engine_options: Mapping[str, object], auth_token: str) -> None:
        import ray

        host = ray.util.get_node_ip_address()
        self._server = EngineServer(
            model, host=host, engine_options=engine_options,
            extra_args=("--auth-token", auth_token),
        )

    def address(self) -> str:
        return self._server.address

    def pid(self) -> int:
        """The server process's id (on the actor's node)."""
        return self._server.pid

    def restart(self) -> str:
        """Kill the server and start a fresh one (the port may change)."""
        return self._server.restart()

    def kill_server(self) -> None:
        """SIGKILL the server (tests: an engine dying under the pool)."""
        self._server.kill()

    def stop(self) -> int | None:
        return self._server.stop()


class RayEngines:
    """The actors, their placement group, and the pool over their servers."""

    def __init__(self, actors: list, placement_group, pool: EnginePool) -> None:
        self.actors = actors
        self.placement_group = placement_group
        self.pool = pool

    def shutdown(self) -> None:
        """Stop every server, end the actors and free their resources."""
        import ray
        from ray.util.placement_group import remove_placement_group

        self.pool.close()
        try:
            ray.get([actor.stop.remote() for actor in self.actors], timeout=60)
        except Exception as exc:  # noqa: BLE001 - dead actors: their servers died with them
            logger.warning("stopping the engine actors: %s", exc)
        for actor in self.actors:
            ray.kill(actor)
        remove_placement_group(self.placement_group)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


def start_engines(
    model: str,
    num_engines: int,
    *,
    num_gpus_per_engine: int = 0,
    num_cpus_per_engine: int = 1,
    engine_options: Mapping[str, object] | None = None,
    strategy: Strategy = "PACK",
    startup_timeout_s: float = 300.0,
    **pool_options: Any,
) -> RayEngines:
    """Place `num_engines` engine servers in one placement group (one bundle each) on the
    connected Ray cluster (`ray.init()` first) and return them behind an `EnginePool`.

    `num_gpus_per_engine` is 1 for one engine per GPU, or the tensor-parallel size.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if num_engines < 1:
        raise ValueError(f"num_engines must be >= 1, got {num_engines}")
    bundle = {"CPU": num_cpus_per_engine, **({"GPU": num_gpus_per_engine}
                                              if num_gpus_per_engine else {})}
    group = placement_group([dict(bundle) for _ in range(num_engines)], strategy=strategy)
    ray.get(group.ready(), timeout=startup_timeout_s)
    auth_token = secrets.token_hex(16)
    actor_cls = ray.remote(EngineServerActor)
    actors = [
        actor_cls.options(
            num_cpus=num_cpus_per_engine, num_gpus=num_gpus_per_engine,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=i
            ),
        ).remote(model, dict(engine_options or {}), auth_token)
        for i in range(num_engines)
    ]
    try:
        addresses = ray.get([actor.address.remote() for actor in actors],
                            timeout=startup_timeout_s)
    except BaseException:
        for actor in actors:
            ray.kill(actor)
        remove_placement_group(group)
        raise
    pool = EnginePool(addresses, auth_token=auth_token, **pool_options)
    return RayEngines(actors, group, pool)
