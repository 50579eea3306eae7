"""Partial rollouts (slime's APRIL, AReaL's interruptible generation): cut the long tail of a
GRPO step by starting more prompt groups than the step needs and taking the first that finish.

    colocation = Colocation(client, sleep_level=2, sleep_mode="keep")
    rollouts = colocation.partial_rollouts(iter(dataset), params, oversample=2.0)
    for step in range(num_steps):
        with colocation.rollout(weights=model):
            batch = rollouts.collect(num_groups=8)   # the first 8 whole groups to finish
        with colocation.training():
            ...                                       # train on batch.groups
        # the groups still running were kept across the sleep: they go on with the new
        # weights and, once complete, come back first, with their mixed weight versions

Each call keeps `oversample x num_groups` groups in flight (new prompts are drawn from the
iterator as groups are returned) and returns as soon as `num_groups` groups are complete (all
`n` samples of a prompt: GRPO's advantages need the whole group). The engine sleeps in "keep"
mode while the trainer trains, so nothing in flight is thrown away; every completion says which
weight version sampled which tokens (`CompletionOutput.weight_versions`), and each logprob is the
one of the policy that sampled its token, so importance-sampling corrections stay exact.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rollout_engine.protocol import CompletionOutput, RequestOutput, SamplingParams
from trainer_bridge.client import CallCancel

if TYPE_CHECKING:
    from trainer_bridge.client import EngineClient

Prompt = str | list[int]


@dataclass
class RolloutGroup:
    """One prompt's `n` completions, and the caller's handle for the prompt."""

    key: Any
    """What the prompt iterator yielded with the prompt (a dataset row, an index...)."""
    output: RequestOutput

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.output.outputs)

    def num_tokens_older_than(self, version: int) -> int:
        """Tokens sampled by a weight version before `version` (off-policy at `version`)."""
        return sum(span.end - span.start for c in self.output.outputs
                   for span in c.weight_versions if span.version < version)


@dataclass
class RolloutBatch:
    """The groups one `collect` returned."""

    groups: list[RolloutGroup]
    weight_version: int
    """The engine's weight version when the batch was returned."""
    num_carried_over: int = 0
    """Groups started before this call (they ran through a training phase)."""

    @property
    def num_tokens(self) -> int:
        return sum(group.num_tokens for group in self.groups)

    @property
    def off_policy_token_fraction(self) -> float:
        """The fraction of the batch's tokens sampled by an older weight version than the
        current one."""
        num_tokens = self.num_tokens
        stale = sum(g.num_tokens_older_than(self.weight_version) for g in self.groups)
        return stale / num_tokens if num_tokens else 0.0


@dataclass(eq=False)  # a group is itself: two prompts may be equal
class _InFlight:
    key: Any
    prompt: Prompt
    sampling_params: SamplingParams
    started_at_call: int
    """The `collect` call that started it."""
    completions: list[CompletionOutput] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    cancel: CallCancel = field(default_factory=CallCancel)
    """Cancelled when the group is restarted as too stale: its call's end is then ignored."""


class PartialRollouts:
    """Keeps `oversample x num_groups` prompt groups generating on one engine; `collect`
    returns the first whole groups to complete, those started by earlier calls first (see the
    module's docstring).

    `prompts` yields `(key, prompt)` pairs, `(key, prompt, sampling_params)` triples (a prompt's
    own parameters, say its `max_tokens`), or bare prompts (their index as the key).
    Each group runs as its own GenerateBatch call on a thread of this object; a group whose
    call fails makes `collect` raise its error.

    `max_staleness` bounds how off-policy a group may get (AReaL's `max_head_offpolicyness`,
    counted in `collect` calls, one per weight update in a colocated loop): a group still
    running when `collect` is called more than `max_staleness` calls after the one that
    started it is cancelled on the engine and its prompt starts anew, so every returned
    group's tokens span at most `max_staleness + 1` weight versions. None: no bound; 0: no
    group crosses a training phase (oversampling only).
    """

    def __init__(
        self,
        client: EngineClient,
        prompts: Iterator[Any],
        sampling_params: SamplingParams,
        oversample: float = 2.0,
        timeout_s: float | None = None,
        max_staleness: int | None = None,
    ) -> None:
        if oversample < 1.0:
            raise ValueError(f"oversample must be >= 1, got {oversample}")
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 or None, got {max_staleness}")
        self.client = client
        self.sampling_params = sampling_params
        self.oversample = oversample
        self.timeout_s = timeout_s
        self.max_staleness = max_staleness
        self.num_restarted = 0
        """Groups restarted for `max_staleness` so far."""
        self._prompts = _keyed(prompts)
        self._done: queue.Queue[tuple[_InFlight, BaseException | None]] = queue.Queue()
        self._running: list[_InFlight] = []
        self._completed: list[_InFlight] = []
        """Complete groups not returned yet, in the order they completed."""
        self._num_calls = 0
        self._threads: list[threading.Thread] = []

    @property
    def num_in_flight(self) -> int:
        """Groups started and not yet returned by `collect`."""
        return len(self._running) + len(self._completed)

    def collect(self, num_groups: int) -> RolloutBatch:
        """`num_groups` whole groups, as soon as that many are complete. Among the complete
        ones, those started by earlier calls (kept through the training phase: the most
        off-policy) go first. A long group is never waited for: it runs on, step after step,
        until it completes (slime's APRIL recycles its partial rollouts the same way). New
        groups start only here, up to `oversample x num_groups` in flight."""
        self._num_calls += 1
        self._restart_stale()
        self._refill(round(self.oversample * num_groups))
        while self._running and len(self._completed) < num_groups:
            group, error = self._done.get()
            if group.cancel.is_cancelled:  # restarted as too stale
                continue
            self._running.remove(group)
            if error is not None:
                raise error
            self._completed.append(group)
        ready = sorted(self._completed, key=lambda g: g.started_at_call)[:num_groups]
        self._completed = [g for g in self._completed if g not in ready]
        return RolloutBatch([self._group(g) for g in ready], self.client.info().weight_version,
                            sum(g.started_at_call < self._num_calls for g in ready))

    def join(self, timeout_s: float | None = None) -> None:
        """Wait for the calls still running (e.g. after aborting them on the engine)."""
        for thread in self._threads:
            thread.join(timeout_s)

    # ------------------------------------------------------------------------ internals
    def _restart_stale(self) -> None:
        if self.max_staleness is None:
            return
        for group in list(self._running):
            if self._num_calls - group.started_at_call > self.max_staleness:
                group.cancel.cancel()  # the server aborts its requests, frozen or not
                self._running.remove(group)
                self._start(group.key, group.prompt, group.sampling_params)
                self.num_restarted += 1

    def _refill(self, target: int) -> None:
        while self.num_in_flight < target:
            try:
                key, prompt, params = next(self._prompts)
            except StopIteration:
                return
            self._start(key, prompt, params or self.sampling_params)

    def _start(self, key: Any, prompt: Prompt, params: SamplingParams) -> None:
        group = _InFlight(key, prompt, params, self._num_calls)
        thread = threading.Thread(target=self._run, args=(group,), daemon=True,
                                  name=f"partial-rollout-{key}")
        self._running.append(group)
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def _run(self, group: _InFlight) -> None:
        """One group's GenerateBatch call; its completions arrive together (when its last
        sample finishes), then the group is handed to `collect`."""
        error: BaseException | None = None
        try:
            for _, prompt_ids, completion in self.client.iter_completions(
                [group.prompt], group.sampling_params, timeout=self.timeout_s,
                cancel=group.cancel,
            ):
                group.prompt_token_ids += prompt_ids
                group.completions.append(completion)
        except BaseException as exc:  # noqa: BLE001 - handed to collect()
            error = exc
        self._done.put((group, error))

    @staticmethod
    def _group(group: _InFlight) -> RolloutGroup:
        completions = sorted(group.completions, key=lambda c: c.index)
        prompt = group.prompt if isinstance(group.prompt, str) else None
        return RolloutGroup(group.key, RequestOutput(str(group.key), group.prompt_token_ids,
                                                     completions, prompt))


def _keyed(prompts: Iterator[Any]) -> Iterator[tuple[Any, Prompt, SamplingParams | None]]:
    for index, item in enumerate(prompts):
        if isinstance(item, tuple) and len(item) == 3:
            yield item
        elif isinstance(item, tuple) and len(item) == 2:
            yield item[0], item[1], None
        else:
            yield index, item, None
