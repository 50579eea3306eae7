"""Data parallelism: many engine servers behind `EngineClient`'s verbs.

`EnginePool(addresses).generate(prompts, params)` splits a rollout across engines:

- a prompt's `n` samples travel as one request, so a GRPO group always stays on one engine
  and shares its prompt's KV blocks;
- prompts that share a prefix (their first `prefix_tokens` tokens, or characters for text)
  go to the engine that saw that prefix before, in this call or an earlier one, so its
  prefix cache is reused, unless that engine is a fair share (the call's samples / engines)
  ahead of the least-loaded one;
- anything else goes to the least-loaded live engine (load = samples assigned).

An engine that stops answering (UNAVAILABLE, or its health check fails) is taken out, and the
prompts it had not answered are sent again, whole, to the others. A dead engine is probed
again before later calls; once it serves, it rejoins, after being given the pool's state:
put to sleep if the pool sleeps, and not used for generation until it holds the pool's weight
weights (the next `update_weights` reaches it). Weight pushes, `sleep`, `wake_up`,
`release_kv_cache_memory` and `reset_prefix_cache` go to every live engine.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Self

from rollout_engine.protocol import (
    DeadlineExceededError,
    EngineInfo,
    MemoryState,
    RequestOutput,
    SamplingParams,
    SleepLevel,
    SleepMode,
    UnavailableError,
)
from trainer_bridge.client import EngineClient, Prompt, per_prompt
from trainer_bridge.transports import for_several_readers

logger = logging.getLogger(__name__)

_MAX_REMEMBERED_PREFIXES = 100_000


@dataclass
class PoolMember:
    """One engine of the pool, as the pool sees it."""

    client: EngineClient
    is_alive: bool = True
    needs_weights: bool = False
    """Restarted, so it lost the pool's weights: no generation until the next update."""
    weight_version: int | None = None
    """Its version after the pool's last weight push (engines count versions on their own:
    one that restarted counts from 0 again); None until weights are pushed."""
    num_assigned_samples: int = 0
    last_probe_s: float = 0.0
    num_failures: int = 0

    @property
    def address(self) -> str:
        return self.client.address

    @property
    def can_generate(self) -> bool:
        return self.is_alive and not self.needs_weights


class EnginePool:
    """`generate`, memory and weight verbs over several `rollout-engine serve` processes."""

    def __init__(
        self,
        engines: Sequence[str | EngineClient],
        *,
        prefix_tokens: int = 64,
        probe_interval_s: float = 1.0,
        **client_options: Any,
    ) -> None:
        if not engines:
            raise ValueError("an EnginePool needs at least one engine address")
        client_options.setdefault("max_retries", 1)
        self.members = [
            PoolMember(e if isinstance(e, EngineClient) else EngineClient(e, **client_options))
            for e in engines
        ]
        self.prefix_tokens = prefix_tokens
        self.probe_interval_s = probe_interval_s
        self._prefix_owner: collections.OrderedDict[Hashable, int] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._has_pushed_weights = False
        self._sleep_level: SleepLevel | None = None
        self._threads = concurrent.futures.ThreadPoolExecutor(
            len(self.members), thread_name_prefix="engine-pool"
        )
        self.last_assignment: dict[int, str] = {}
        """Which engine answered each prompt of the last `generate` (prompt index -> address)."""

    @property
    def address(self) -> str:
        return "pool(" + ", ".join(m.address for m in self.members) + ")"

    @property
    def live_addresses(self) -> list[str]:
        return [m.address for m in self.members if m.is_alive]

    def close(self) -> None:
        self._threads.shutdown(wait=True, cancel_futures=True)
        for member in self.members:
            member.client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def wait_until_ready(self, timeout: float = 60.0) -> None:
        for member in self.members:
            member.client.wait_until_ready(timeout)

    # ------------------------------------------------------------------------- generation
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        timeout: float | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order, as `EngineClient.generate` returns; an
        engine dying mid-call costs its prompts a second run elsewhere, nothing more."""
        prompts, params = per_prompt(prompts, sampling_params)
        self._probe_dead_members()
        self._check_weight_versions()
        results: dict[int, RequestOutput] = {}
        self.last_assignment = {}
        pending = list(range(len(prompts)))
        while pending:
            assignment = self._assign(prompts, params, pending)
            futures = {
                self._threads.submit(
                    self._generate_on, member_index, prompts, params, indices, timeout
                ): (member_index, indices)
                for member_index, indices in assignment.items()
            }
            pending = []
            for future in concurrent.futures.as_completed(futures):
                member_index, indices = futures[future]
                member = self.members[member_index]
                try:
                    outputs = future.result()
                except (UnavailableError, DeadlineExceededError) as exc:
                    self._take_out(member, exc)
                    pending += indices
                    continue
                finally:
                    self._release(member, params, indices)
                if not self._has_pool_weights(member, outputs):
                    pending += indices  # restarted between calls: stale weights, run again
                    continue
                for index, output in zip(indices, outputs):
                    output.request_id = str(index)
                    results[index] = output
                    self.last_assignment[index] = member.address
            pending.sort()
        return [results[i] for i in range(len(prompts))]

    def _has_pool_weights(self, member: PoolMember, outputs: list[RequestOutput]) -> bool:
        """Whether every completion came from the pool's weights; if not, the engine is kept
        from generating until the next update reaches it."""
        expected = member.weight_version
        if expected is None or all(
            c.weight_version == expected for o in outputs for c in o.outputs
        ):
            return True
        with self._lock:
            member.needs_weights = True
        logger.warning("engine %s answered with weight version other than %d (restarted?); "
                       "its prompts run elsewhere", member.address, expected)
        return False

    def _generate_on(self, member_index, prompts, params, indices, timeout):
        member = self.members[member_index]
        return member.client.generate(
            [prompts[i] for i in indices], [params[i] for i in indices], timeout
        )

    def _assign(self, prompts, params, indices: list[int]) -> dict[int, list[int]]:
        """Each prompt to the engine that owns its prefix, else to the least loaded one."""
        assignment: dict[int, list[int]] = collections.defaultdict(list)  # member -> prompts
        with self._lock:
            candidates = [i for i, m in enumerate(self.members) if m.can_generate]
            if not candidates:
                raise UnavailableError(
                    f"no engine of the pool can generate: {self._describe_members()}"
                )
            # Prefix affinity yields to balance once an owner is a fair share ahead.
            num_samples = sum(params[i].n for i in indices)
            fair_share = -(-num_samples // len(candidates))
            for index in indices:
                key = self._prefix_key(prompts[index])
                owner = self._prefix_owner.get(key)
                least = min(candidates, key=lambda i: self.members[i].num_assigned_samples)
                least_load = self.members[least].num_assigned_samples
                if owner not in candidates or (
                    self.members[owner].num_assigned_samples + params[index].n
                    > least_load + fair_share
                ):
                    owner = least
                self._remember_prefix(key, owner)
                assignment[owner].append(index)
                self.members[owner].num_assigned_samples += params[index].n
        return assignment

    def _release(self, member: PoolMember, params, indices: list[int]) -> None:
        with self._lock:
            member.num_assigned_samples -= sum(params[i].n for i in indices)

    def _prefix_key(self, prompt: Prompt) -> Hashable:
        if isinstance(prompt, str):
            return prompt[: 4 * self.prefix_tokens]  # about as many characters as tokens
        return tuple(prompt[: self.prefix_tokens])

    def _remember_prefix(self, key: Hashable, owner: int) -> None:
        self._prefix_owner[key] = owner
        self._prefix_owner.move_to_end(key)
        while len(self._prefix_owner) > _MAX_REMEMBERED_PREFIXES:
            self._prefix_owner.popitem(last=False)

    # ----------------------------------------------------------------- members in and out
    def _take_out(self, member: PoolMember, exc: BaseException) -> None:
        with self._lock:
            if member.is_alive:
                logger.warning("engine %s left the pool: %s", member.address, exc)
            member.is_alive = False
            member.num_failures += 1
            member.last_probe_s = time.monotonic()

    def _probe_dead_members(self) -> None:
        """Health-check engines that left; one that serves again rejoins in the pool's state."""
        now = time.monotonic()
        for member in self.members:
            if member.is_alive or now - member.last_probe_s < self.probe_interval_s:
                continue
            member.last_probe_s = now
            try:
                member.client.wait_until_ready(timeout=0.5)
                info = member.client.info()
                if self._sleep_level is not None:
                    member.client.sleep(self._sleep_level)
            except Exception as exc:  # noqa: BLE001 - still down: try again later
                logger.debug("engine %s still down: %s", member.address, exc)
                continue
            with self._lock:
                member.is_alive = True
                member.needs_weights = (
                    self._has_pushed_weights and info.weight_version != member.weight_version
                )
            logger.warning("engine %s rejoined the pool%s", member.address,
                           " (it generates once the next weight update reaches it)"
                           if member.needs_weights else "")

    def _check_weight_versions(self) -> None:
        """Once weights were pushed through the pool, an engine restarted between calls (its
        version differs) generates only after the next update reaches it."""
        for member in self.members:
            if not member.can_generate or member.weight_version is None:
                continue
            try:
                version = member.client.info().weight_version
            except (UnavailableError, DeadlineExceededError) as exc:
                self._take_out(member, exc)
                continue
            if version != member.weight_version:
                with self._lock:
                    member.needs_weights = True

    def _describe_members(self) -> str:
        return ", ".join(
            f"{m.address} ({'alive' if m.is_alive else 'down'}"
            f"{', needs weights' if m.needs_weights else ''})" for m in self.members
        )

    def _broadcast(self, verb: str, *args: Any, **kwargs: Any) -> list[tuple[PoolMember, Any]]:
        """Call `verb` on every live engine at once: (engine, its answer) for each that
        answered; engines that fail to answer leave."""
        self._probe_dead_members()
        live = [m for m in self.members if m.is_alive]
        if not live:
            raise UnavailableError(f"no engine of the pool is alive: {self._describe_members()}")
        futures = {self._threads.submit(getattr(m.client, verb), *args, **kwargs): m for m in live}
        results = []
        for future, member in futures.items():
            try:
                results.append((member, future.result()))
            except (UnavailableError, DeadlineExceededError) as exc:
                self._take_out(member, exc)
        if not results:
            raise UnavailableError(f"every engine failed {verb}: {self._describe_members()}")
        return results

    # --------------------------------------------------------------- every engine at once
    def sleep(self, level: SleepLevel | int = 1, mode: SleepMode = "abort") -> int:
        self._sleep_level = SleepLevel.parse(level)
        return sum(n for _, n in self._broadcast("sleep", level, mode))

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        self._sleep_level = None
        self._broadcast("wake_up", tags)

    def release_kv_cache_memory(self) -> int:
        return sum(n for _, n in self._broadcast("release_kv_cache_memory"))

    def reset_prefix_cache(self) -> None:
        self._broadcast("reset_prefix_cache")

    def update_weights(self, weights, **options: Any) -> int:
        """Push the same weights to every live engine, at once; the highest new version
        (engines count versions on their own, so one that restarted reports a lower one).

        Each engine reads the weights, so they are held as a list (a generator is read into
        one first). Engines that rejoined without the pool's weights get them too, and
        generate again.
        """
        weights = for_several_readers(weights, options.get("manifest"))
        versions = self._broadcast("update_weights", weights, **options)
        with self._lock:
            self._has_pushed_weights = True
            for member, version in versions:
                member.weight_version = version
                member.needs_weights = False
        return max(version for _, version in versions)

    # ----------------------------------------------------------------------- introspection
    def info(self) -> EngineInfo:
        """The first live engine's facts (all serve the same model)."""
        return self._first_live().client.info()

    def memory_state(self) -> MemoryState:
        """The first live engine's memory state (every engine gets the same verbs)."""
        return self._first_live().client.memory_state()

    def _first_live(self) -> PoolMember:
        self._probe_dead_members()
        for member in self.members:
            if member.is_alive:
                return member
        raise UnavailableError(f"no engine of the pool is alive: {self._describe_members()}")
