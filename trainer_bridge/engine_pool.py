"""Data parallelism: many engine servers behind `EngineClient`'s verbs.

`EnginePool(addresses).generate(prompts, params)` splits a rollout across engines:

- a prompt's `n` samples travel as one request, so a GRPO group always stays on one engine
  and shares its prompt's KV blocks;
- prompts that share a prefix (their first `prefix_tokens` tokens, or characters for text)
  go to the engine that saw that prefix before, in this call or an earlier one, so its
  prefix cache is reused, unless that engine is a fair share (the call's samples / engines)
  ahead of the least-loaded one;
- anything else goes to the least-loaded live engine (load = samples assigned);
- with `session_ids` (one per prompt, None for none), every prompt of a session goes to the
  engine that served the session before, whatever its load, unless that engine is gone: a
  multi-turn conversation's next turn finds its earlier turns' KV there.

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
from trainer_bridge.client import CallCancel, EngineClient
from trainer_bridge.client_messages import Prompt, per_prompt
from trainer_bridge.pool_membership import PoolMember, PoolMembership
from trainer_bridge.transports import for_several_readers

_MAX_REMEMBERED_OWNERS = 100_000


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
        self.membership = PoolMembership(
            [e if isinstance(e, EngineClient) else EngineClient(e, **client_options)
             for e in engines],
            probe_interval_s,
        )
        self.prefix_tokens = prefix_tokens
        self._prefix_owner: collections.OrderedDict[Hashable, int] = collections.OrderedDict()
        self._session_owner: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._threads = concurrent.futures.ThreadPoolExecutor(
            len(self.members), thread_name_prefix="engine-pool"
        )
        self.last_assignment: dict[int, str] = {}
        """Which engine answered each prompt of the last `generate` (prompt index -> address)."""

    @property
    def members(self) -> list[PoolMember]:
        return self.membership.members

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
        session_ids: Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order, as `EngineClient.generate` returns; an
        engine dying mid-call costs its prompts a second run elsewhere, nothing more.
        `session_ids`: see the module's docstring."""
        prompts, params = per_prompt(prompts, sampling_params)
        if session_ids is not None and len(session_ids) != len(prompts):
            raise InvalidRequestError(f"got {len(session_ids)} session ids for {len(prompts)} "
                                      "prompts; one each (None for none)")
        self.membership.probe_dead()
        self.membership.check_weight_versions()
        results: dict[int, RequestOutput] = {}
        self.last_assignment = {}
        pending = list(range(len(prompts)))
        while pending:
            assignment = self._assign(prompts, params, pending, session_ids)
            pending = sorted(self._run_round(assignment, prompts, params, timeout, results))
        return [results[i] for i in range(len(prompts))]

    def render_chat(self, *args: Any, **kwargs: Any) -> tuple[list[int], str]:
        """`EngineClient.render_chat` on a live engine (every engine renders alike)."""
        return self.membership.first_live().client.render_chat(*args, **kwargs)

    def _run_round(self, assignment, prompts, params, timeout, results) -> list[int]:
        """Send each engine its prompts and settle every call; the prompts to send again.

        An engine that fails with anything but unavailability fails the whole request: the
        other calls are cancelled, and its error is raised once all have settled."""
        calls = {}
        for member_index, indices in assignment.items():
            call = _Call(self.members[member_index], indices, CallCancel(),
                         self.membership.num_pushes)
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
                self.membership.take_out(call.member, exc)
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
            if not self.membership.has_pool_weights(call.member, call.weight_push, versions):
                pending += call.indices
                continue
            for index, output in zip(call.indices, outputs):
                output.request_id = str(index)
                results[index] = output
                self.last_assignment[index] = call.member.address
        if failure is not None:
            raise _naming_engine(*failure)
        return pending

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
        self.membership.probe_dead()
        self.membership.check_weight_versions()
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
            call = _Call(member, indices, CallCancel(), self.membership.num_pushes)
            calls[future] = (member_index, call)
        failed: list[int] = []
        failure: tuple[PoolMember, Exception] | None = None
        for future in concurrent.futures.as_completed(calls):
            member_index, call = calls[future]
            try:
                scores = future.result()
            except (UnavailableError, DeadlineExceededError) as exc:
                self.membership.take_out(call.member, exc)
                failed.append(member_index)
                continue
            except Exception as exc:  # noqa: BLE001 - raised once every call has settled
                failure = failure or (call.member, exc)
                continue
            versions = [o.weight_version for o in scores]
            if not self.membership.has_pool_weights(call.member, call.weight_push, versions):
                failed.append(member_index)
                continue
            results.update(zip(call.indices, scores))
        if failure is not None:
            raise _naming_engine(*failure)
        return failed

    def _release_all(self, assignment: dict[int, list[int]], loads) -> None:
        for member_index, indices in assignment.items():
            self._release(self.members[member_index], loads, indices)

    def _assign(self, prompts, params, indices: list[int],
                session_ids: Sequence[str | None] | None = None) -> dict[int, list[int]]:
        """Each prompt to the engine that holds its session, else to the one that owns its
        prefix, else to the least loaded one."""
        assignment: dict[int, list[int]] = collections.defaultdict(list)  # member -> prompts
        membership = self.membership
        with membership.lock:
            candidates = [i for i, m in enumerate(self.members) if membership.can_generate(m)]
            if not candidates:
                raise UnavailableError(
                    f"no engine of the pool can generate: {membership.describe()}"
                )
            # Prefix affinity yields to balance once an owner is a fair share ahead.
            num_samples = sum(params[i].n for i in indices)
            fair_share = -(-num_samples // len(candidates))
            for index in indices:
                session = session_ids[index] if session_ids is not None else None
                owner = self._session_owner.get(session) if session is not None else None
                if owner not in candidates:
                    owner = self._by_prefix_or_load(prompts[index], params[index], candidates,
                                                    fair_share)
                if session is not None:
                    _remember(self._session_owner, session, owner)
                assignment[owner].append(index)
                self.members[owner].num_assigned_samples += params[index].n
        return assignment

    def _by_prefix_or_load(self, prompt: Prompt, params: SamplingParams, candidates: list[int],
                           fair_share: int) -> int:
        key = self._prefix_key(prompt)
        owner = self._prefix_owner.get(key)
        least = min(candidates, key=lambda i: self.members[i].num_assigned_samples)
        least_load = self.members[least].num_assigned_samples
        if owner not in candidates or (
            self.members[owner].num_assigned_samples + params.n > least_load + fair_share
        ):
            owner = least
        _remember(self._prefix_owner, key, owner)
        return owner

    def _release(self, member: PoolMember, params, indices: list[int]) -> None:
        with self.membership.lock:
            member.num_assigned_samples -= sum(params[i].n for i in indices)

    def _prefix_key(self, prompt: Prompt) -> Hashable:
        if isinstance(prompt, str):
            return prompt[: 4 * self.prefix_tokens]  # about as many characters as tokens
        return tuple(prompt[: self.prefix_tokens])

    # --------------------------------------------------------------- every engine at once
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
            raise UnavailableError(f"every engine failed {verb}: {self.membership.describe()}")
        return answers

    def _call_every_live(
        self, verb: str, *args: Any, **kwargs: Any
    ) -> tuple[list[tuple[PoolMember, Any]], list[tuple[PoolMember, EngineError]]]:
        """(answers, errors other than unavailability) of `verb` on every live engine."""
        self.membership.probe_dead()
        live = self.membership.live()
        if not live:
            raise UnavailableError(f"no engine of the pool is alive: {self.membership.describe()}")
        futures = {self._threads.submit(getattr(m.client, verb), *args, **kwargs): m for m in live}
        answers, failures = [], []
        for future, member in futures.items():
            try:
                answers.append((member, future.result()))
            except (UnavailableError, DeadlineExceededError) as exc:
                self.membership.take_out(member, exc)
            except EngineError as exc:
                failures.append((member, exc))
        return answers, failures

    def sleep(self, level: SleepLevel | int = 1, mode: SleepMode = "abort") -> int:
        self.membership.sleep_level = SleepLevel.parse(level)
        return sum(n for _, n in self._broadcast("sleep", level, mode))

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        self.membership.sleep_level = None
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
        self.membership.record_push(answers)
        return max(version for _, version in self._answered("update_weights", answers, failures))

    # ----------------------------------------------------------------------- introspection
    def info(self) -> EngineInfo:
        """The first live engine's facts (all serve the same model)."""
        return self.membership.first_live().client.info()

    def memory_state(self) -> MemoryState:
        """The first live engine's memory state (every engine gets the same verbs)."""
        return self.membership.first_live().client.memory_state()


def _remember(owners: collections.OrderedDict, key: Hashable, owner: int) -> None:
    """Record an owner, most recent last; the oldest are forgotten past a bound."""
    owners[key] = owner
    owners.move_to_end(key)
    while len(owners) > _MAX_REMEMBERED_OWNERS:
        owners.popitem(last=False)


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
