"""Data parallelism: many engine servers behind `EngineClient`'s verbs.

`EnginePool(addresses).generate(prompts, params)` splits a rollout across engines:

- a prompt's `n` samples travel as one request, so a GRPO group always stays on one engine
  and shares its prompt's KV blocks;
- prompts that share a prefix (their first `prefix_tokens` tokens, or characters for text)
  go to the engine that saw that prefix before, in this call or an earlier one, so its
  prefix cache is reused, unless that engine is a fair share (the call's samples / engines)
  ahead of the least-loaded one;
- anything else goes to the least-loaded live engine (load = samples assigned).

`score(sequences, prompt_lens)` places sequences the same way, those sharing a prompt together.

An engine that stops answering (UNAVAILABLE, or its health check fails) is taken out, and the
prompts it had not answered are sent again, whole, to the others. A dead engine is probed
again before later calls; once it serves, it rejoins in the pool's state (put to sleep if the
pool sleeps). Weight pushes, `sleep`, `wake_up`, `release_kv_cache_memory` and
`reset_prefix_cache` go to every live engine.

The pool tracks weight pushes, not versions: an engine that a push did not reach in full
(down, unreachable, or failed during it) and one that restarted since (it reports another
version) generate nothing until a later push reaches them, and a completion enters a result
only if it carries the version its engine reported after the pool's latest push.

When one engine's call fails for any other reason (an invalid prompt, admission, a failed
step), the calls to the other engines are cancelled, every engine's load is released, and the
first error is raised with the engine's address in its message.
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
    EngineError,
    EngineInfo,
    InvalidRequestError,
    MemoryState,
    RequestOutput,
    SamplingParams,
    ScoreOutput,
    SleepLevel,
    SleepMode,
    UnavailableError,
)
from trainer_bridge.client import CallCancel, EngineClient, Prompt, per_prompt
from trainer_bridge.transports import for_several_readers

logger = logging.getLogger(__name__)

_MAX_REMEMBERED_PREFIXES = 100_000


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


@dataclass
class _Call:
    """One engine's share of a `generate` round."""

    member: PoolMember
    indices: list[int]
    cancel: CallCancel
    weight_push: int
    """The pool's latest push when the call was sent."""


class EnginePool:
    """`generate`, `score`, memory and weight verbs over several `rollout-engine serve`
    processes."""

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
        self._num_pushes = 0
        """Weight pushes through the pool that reached at least one engine."""
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
            pending = sorted(self._run_round(assignment, prompts, params, timeout, results))
        return [results[i] for i in range(len(prompts))]

    def _run_round(self, assignment, prompts, params, timeout, results) -> list[int]:
        """Send each engine its prompts and settle every call; the prompts to send again.

        An engine that fails with anything but unavailability fails the whole request: the
        other calls are cancelled, and its error is raised once all have settled."""
        calls = {}
        for member_index, indices in assignment.items():
            call = _Call(self.members[member_index], indices, CallCancel(), self._num_pushes)
            future = self._threads.submit(
                call.member.client.generate, [prompts[i] for i in indices],
                [params[i] for i in indices], timeout, call.cancel,
            )
            calls[future] = call
        pending: list[int] = []
        failure: tuple[PoolMember, Exception] | None = None
        for future in concurrent.futures.as_completed(calls):
            call = calls[future]
            self._release(call.member, params, call.indices)
            try:
                outputs = future.result()
            except (UnavailableError, DeadlineExceededError) as exc:
                self._take_out(call.member, exc)
                pending += call.indices
                continue
            except Exception as exc:  # noqa: BLE001 - raised once every call has settled
                if failure is None:
                    failure = (call.member, exc)
                    for other in calls.values():
                        other.cancel.cancel()
                continue
            if failure is not None:
                continue
            versions = [c.weight_version for o in outputs for c in o.outputs]
            if not self._has_pool_weights(call, versions):
                pending += call.indices
                continue
            for index, output in zip(call.indices, outputs):
                output.request_id = str(index)
                results[index] = output
                self.last_assignment[index] = call.member.address
        if failure is not None:
            raise _naming_engine(*failure)
        return pending

    def _has_pool_weights(self, call: _Call, weight_versions: list[int]) -> bool:
        """Whether every answer (completion, score) came from the weights of the pool's
        latest push; if the engine answered with another version though no push came in
        between, it restarted and generates nothing until the next push reaches it."""
        member = call.member
        with self._lock:
            if call.weight_push != self._num_pushes or not self._can_generate(member):
                return False  # a push went by while it generated
            expected = member.weight_version
            if expected is None or all(v == expected for v in weight_versions):
                return True
            member.weight_push = _STALE_PUSH
        logger.warning("engine %s answered with weight version other than %d (restarted?); "
                       "its prompts run elsewhere", member.address, expected)
        return False

    # ---------------------------------------------------------------------------- scoring
    def score(
        self,
        sequences: Sequence[Sequence[int]],
        prompt_lens: Sequence[int],
        logprobs: int | None = None,
        timeout: float | None = None,
    ) -> list[ScoreOutput]:
        """One ScoreOutput per sequence, in order, as `EngineClient.score` returns. Sequences
        that share a prompt go to one engine together (they share its KV), placed as
        `generate` places prompts; an engine dying mid-call costs its sequences a second run
        elsewhere."""
        if len(sequences) != len(prompt_lens):
            raise InvalidRequestError(
                f"got {len(sequences)} sequences and {len(prompt_lens)} prompt_lens; one each"
            )
        groups: dict[tuple[int, ...], list[int]] = collections.defaultdict(list)
        for i, (sequence, prompt_len) in enumerate(zip(sequences, prompt_lens)):
            groups[tuple(sequence[:prompt_len])].append(i)
        prompts = [list(prompt) for prompt in groups]
        members = list(groups.values())
        # Load is counted in samples: one per scored sequence.
        loads = [SamplingParams(n=len(indices), max_tokens=1) for indices in members]
        self._probe_dead_members()
        self._check_weight_versions()
        results: dict[int, ScoreOutput] = {}
        pending = list(range(len(prompts)))
        while pending:
            assignment = self._assign(prompts, loads, pending)
            rounds = {engine: [i for g in group_ids for i in members[g]]
                      for engine, group_ids in assignment.items()}
            try:
                failed = self._run_score_round(rounds, sequences, prompt_lens, logprobs, timeout,
                                               results)
            finally:
                self._release_all(assignment, loads)
            pending = sorted(g for engine in failed for g in assignment[engine])
        return [results[i] for i in range(len(sequences))]

    def _run_score_round(self, rounds, sequences, prompt_lens, logprobs, timeout,
                         results) -> list[int]:
        """Score each engine's sequences; the engines whose sequences must run again."""
        calls = {}
        for member_index, indices in rounds.items():
            member = self.members[member_index]
            future = self._threads.submit(
                member.client.score, [sequences[i] for i in indices],
                [prompt_lens[i] for i in indices], logprobs, timeout,
            )
            calls[future] = (member_index, _Call(member, indices, CallCancel(), self._num_pushes))
        failed: list[int] = []
        failure: tuple[PoolMember, Exception] | None = None
        for future in concurrent.futures.as_completed(calls):
            member_index, call = calls[future]
            try:
                scores = future.result()
            except (UnavailableError, DeadlineExceededError) as exc:
                self._take_out(call.member, exc)
                failed.append(member_index)
                continue
            except Exception as exc:  # noqa: BLE001 - raised once every call has settled
                failure = failure or (call.member, exc)
                continue
            if not self._has_pool_weights(call, [o.weight_version for o in scores]):
                failed.append(member_index)
                continue
            results.update(zip(call.indices, scores))
        if failure is not None:
            raise _naming_engine(*failure)
        return failed

    def _release_all(self, assignment: dict[int, list[int]], loads) -> None:
        for member_index, indices in assignment.items():
            self._release(self.members[member_index], loads, indices)

    def _can_generate(self, member: PoolMember) -> bool:
        return member.is_alive and member.weight_push == self._num_pushes

    def _assign(self, prompts, params, indices: list[int]) -> dict[int, list[int]]:
        """Each prompt to the engine that owns its prefix, else to the least loaded one."""
        assignment: dict[int, list[int]] = collections.defaultdict(list)  # member -> prompts
        with self._lock:
            candidates = [i for i, m in enumerate(self.members) if self._can_generate(m)]
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
                if self._sleep_level is not None:
                    member.client.sleep(self._sleep_level)
            except Exception as exc:  # noqa: BLE001 - still down: try again later
                logger.debug("engine %s still down: %s", member.address, exc)
                continue
            with self._lock:
                member.is_alive = True
                self._forget_weights_if_restarted(member, info.weight_version)
                current = self._can_generate(member)
            logger.warning("engine %s rejoined the pool%s", member.address, "" if current
                           else " (it generates once the next weight update reaches it)")

    def _check_weight_versions(self) -> None:
        """An engine restarted between calls (its version differs from the one it reported
        after its last push) generates only after the next push reaches it."""
        for member in self.members:
            if not self._can_generate(member) or member.weight_version is None:
                continue
            try:
                version = member.client.info().weight_version
            except (UnavailableError, DeadlineExceededError) as exc:
                self._take_out(member, exc)
                continue
            with self._lock:
                self._forget_weights_if_restarted(member, version)

    def _forget_weights_if_restarted(self, member: PoolMember, version: int) -> None:
        if member.weight_version is not None and version != member.weight_version:
            member.weight_push = _STALE_PUSH

    def _describe_members(self) -> str:
        return ", ".join(
            f"{m.address} ({'alive' if m.is_alive else 'down'}"
            f"{'' if m.weight_push == self._num_pushes else ', missed a weight push'})"
            for m in self.members
        )

    def _broadcast(self, verb: str, *args: Any, **kwargs: Any) -> list[tuple[PoolMember, Any]]:
        """Call `verb` on every live engine at once and wait for all: (engine, its answer) for
        each that answered. Engines that fail to answer leave; any other error is raised,
        naming its engine, once every call has settled."""
        return self._answered(verb, *self._call_every_live(verb, *args, **kwargs))

    def _answered(self, verb: str, answers, failures) -> list[tuple[PoolMember, Any]]:
        """The answers of a call to every live engine, unless one failed (its error, naming
        it) or none answered (UnavailableError)."""
        if failures:
            raise _naming_engine(*failures[0])
        if not answers:
            raise UnavailableError(f"every engine failed {verb}: {self._describe_members()}")
        return answers

    def _call_every_live(
        self, verb: str, *args: Any, **kwargs: Any
    ) -> tuple[list[tuple[PoolMember, Any]], list[tuple[PoolMember, EngineError]]]:
        """(answers, errors other than unavailability) of `verb` on every live engine."""
        self._probe_dead_members()
        live = [m for m in self.members if m.is_alive]
        if not live:
            raise UnavailableError(f"no engine of the pool is alive: {self._describe_members()}")
        futures = {self._threads.submit(getattr(m.client, verb), *args, **kwargs): m for m in live}
        answers, failures = [], []
        for future, member in futures.items():
            try:
                answers.append((member, future.result()))
            except (UnavailableError, DeadlineExceededError) as exc:
                self._take_out(member, exc)
            except EngineError as exc:
                failures.append((member, exc))
        return answers, failures

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
        generate again. Once the push reached any engine, those it did not reach in full
        (down, or failed during it) generate nothing until a later push reaches them; an
        error other than unavailability is raised, naming its engine, after that.
        """
        weights = for_several_readers(weights, options.get("manifest"))
        answers, failures = self._call_every_live("update_weights", weights, **options)
        with self._lock:
            if answers:
                self._num_pushes += 1
            for member, version in answers:
                member.weight_push = self._num_pushes
                member.weight_version = version
        return max(version for _, version in self._answered("update_weights", answers, failures))

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


def _naming_engine(member: PoolMember, exc: Exception) -> Exception:
    """`exc` again, of the same type, with the engine's address in front of its message (an
    error that is not the engine's gets the address as a note)."""
    if not isinstance(exc, EngineError):
        exc.add_note(f"while calling engine {member.address}")
        return exc
    error = type(exc)(f"engine {member.address}: {exc}", request_ids=exc.request_ids)
    error.error_type = exc.error_type
    error.__cause__ = exc
    return error
