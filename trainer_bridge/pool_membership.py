"""Which engines of an `EnginePool` may serve: taken out when they stop answering, probed and let
back in, and allowed to generate only while they hold the weights of the pool's latest push."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from rollout_engine.protocol import DeadlineExceededError, SleepLevel, UnavailableError
from trainer_bridge.client import EngineClient

logger = logging.getLogger(__name__)

_STALE_PUSH = -1
"""`PoolMember.weight_push` of an engine that lost the weights it was pushed (restarted)."""


@dataclass
class PoolMember:
    """One engine of the pool, as the pool sees it."""

    client: EngineClient
    is_alive: bool = True
    weight_push: int = 0
    """The number of the last pool push this engine received in full (0: none, it serves its
    checkpoint); it may generate only while this is the pool's latest push."""
    weight_version: int | None = None
    """The version it reported after that push (engines count versions on their own: one that
    restarted counts from 0 again); None until weights are pushed."""
    num_assigned_samples: int = 0
    last_probe_s: float = 0.0
    num_failures: int = 0

    @property
    def address(self) -> str:
        return self.client.address


class PoolMembership:
    """The pool's engines and what it knows of each; changed under `lock` (the pool's verbs may
    run on several threads at once)."""

    def __init__(self, clients: Sequence[EngineClient], probe_interval_s: float) -> None:
        self.members = [PoolMember(client) for client in clients]
        self.probe_interval_s = probe_interval_s
        self.lock = threading.Lock()
        self.num_pushes = 0
        """Weight pushes through the pool that reached at least one engine."""
        self.sleep_level: SleepLevel | None = None
        """The level the pool sleeps at (None: awake); an engine that rejoins is put to it."""

    def can_generate(self, member: PoolMember) -> bool:
        return member.is_alive and member.weight_push == self.num_pushes

    def live(self) -> list[PoolMember]:
        return [m for m in self.members if m.is_alive]

    def first_live(self) -> PoolMember:
        self.probe_dead()
        for member in self.members:
            if member.is_alive:
                return member
        raise UnavailableError(f"no engine of the pool is alive: {self.describe()}")

    def describe(self) -> str:
        """Every engine's address and state, for an error message."""
        return ", ".join(
            f"{m.address} ({'alive' if m.is_alive else 'down'}"
            f"{'' if m.weight_push == self.num_pushes else ', missed a weight push'})"
            for m in self.members
        )

    # ------------------------------------------------------------------------- weight pushes
    def record_push(self, answers: list[tuple[PoolMember, int]]) -> None:
        """A push reached the engines that answered (each with its new version); if it reached
        any, the others no longer hold the pool's weights."""
        with self.lock:
            if answers:
                self.num_pushes += 1
            for member, version in answers:
                member.weight_push = self.num_pushes
                member.weight_version = version

    def has_pool_weights(
        self, member: PoolMember, weight_push: int, weight_versions: list[int]
    ) -> bool:
        """Whether every answer (completion, score) of a call sent at push `weight_push` came
        from the weights of the pool's latest push; if the engine answered with another version
        though no push came in between, it restarted and generates nothing until the next push
        reaches it."""
        with self.lock:
            if weight_push != self.num_pushes or not self.can_generate(member):
                return False  # a push went by while it generated
            expected = member.weight_version
            if expected is None or all(v == expected for v in weight_versions):
                return True
            member.weight_push = _STALE_PUSH
        logger.warning("engine %s answered with weight version other than %d (restarted?); "
                       "its prompts run elsewhere", member.address, expected)
        return False

    def check_weight_versions(self) -> None:
        """An engine restarted between calls (its version differs from the one it reported
        after its last push) generates only after the next push reaches it."""
        for member in self.members:
            if not self.can_generate(member) or member.weight_version is None:
                continue
            try:
                version = member.client.info().weight_version
            except (UnavailableError, DeadlineExceededError) as exc:
                self.take_out(member, exc)
                continue
            with self.lock:
                self._forget_weights_if_restarted(member, version)

    # ---------------------------------------------------------------------- out and back in
    def take_out(self, member: PoolMember, exc: BaseException) -> None:
        with self.lock:
            if member.is_alive:
                logger.warning("engine %s left the pool: %s", member.address, exc)
            member.is_alive = False
            member.num_failures += 1
            member.last_probe_s = time.monotonic()

    def probe_dead(self) -> None:
        """Health-check engines that left; one that serves again rejoins in the pool's state
        (it generates only if it holds the weights of the pool's latest push)."""
        now = time.monotonic()
        for member in self.members:
            if member.is_alive or now - member.last_probe_s < self.probe_interval_s:
                continue
            member.last_probe_s = now
            try:
                member.client.wait_until_ready(timeout=0.5)
                info = member.client.info()
                if self.sleep_level is not None:
                    member.client.sleep(self.sleep_level)
            except Exception as exc:  # noqa: BLE001 - still down: try again later
                logger.debug("engine %s still down: %s", member.address, exc)
                continue
            with self.lock:
                member.is_alive = True
                self._forget_weights_if_restarted(member, info.weight_version)
                current = self.can_generate(member)
            logger.warning("engine %s rejoined the pool%s", member.address, "" if current
                           else " (it generates once the next weight update reaches it)")

    def _forget_weights_if_restarted(self, member: PoolMember, version: int) -> None:
        if member.weight_version is not None and version != member.weight_version:
            member.weight_push = _STALE_PUSH
