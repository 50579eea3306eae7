"""Landing steps: commit a step's tokens once its forward is done, and end the prompts of a
step that failed or dead-ended (DESIGN "Fault safety")."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from rollout_engine.engine.step_executor import FailedSteps, LandedStep, StepExecutor
from rollout_engine.engine.step_failures import dead_end_error, step_error
from rollout_engine.protocol import GrammarDeadEndError, RequestOutput

if TYPE_CHECKING:
    from rollout_engine.core.request import Request
    from rollout_engine.core.scheduler import Scheduler
    from rollout_engine.core.scheduler_output import SchedulerOutput
    from rollout_engine.engine.output_processor import OutputProcessor
    from rollout_engine.worker.routed_experts import RoutingStore

logger = logging.getLogger(__name__)


class StepLander:
    """Lands the steps in flight, oldest first: `update_from_output`, then the engine's hook
    after it. Ends (through `end_prompts`, the engine's abort) the prompts a step could not
    serve; their errors carry `request_ids`, so that the server hands each caller its own."""

    def __init__(
        self,
        executor: StepExecutor,
        scheduler: Scheduler,
        output_processor: OutputProcessor,
        end_prompts: Callable[[list[str]], None],
        after_update: Callable[[LandedStep, list[Request]], None],
        weight_version: Callable[[], int],
        vocab_size: int,
        routed_experts: RoutingStore | None = None,
    ) -> None:
        self.executor = executor
        self.scheduler = scheduler
        self.output_processor = output_processor
        self._end_prompts = end_prompts
        self._after_update = after_update
        self._weight_version = weight_version
        self._vocab_size = vocab_size
        self._routed_experts = routed_experts
        """MoE routing beside the KV: read for each request as it finishes, and for a stream's
        as each step lands."""
        self.pending_outputs: list[RequestOutput] = []
        """Outputs of steps landed outside `step()` (before a sleep...), returned by the next."""

    def take_pending_outputs(self) -> list[RequestOutput]:
        outputs, self.pending_outputs = self.pending_outputs, []
        return outputs

    def land(self) -> list[Request]:
        """Land the oldest step in flight and commit its tokens; the requests it updated.

        If it failed, the steps after it (which read its tokens) went with it, and every
        prompt they scheduled is ended: see `_fail`. If a constraint of the step dead-ended,
        its prompt alone is ended: see `_end_dead_ended`.
        """
        landed = self.executor.land()
        if isinstance(landed, FailedSteps):
            error = self._fail(landed.scheduler_outputs, landed.error)
            if error is landed.error:
                raise error
            raise error from landed.error
        tables = self._block_tables(landed.scheduler_output)
        updated = self.scheduler.update_from_output(landed.scheduler_output, landed.runner_output)
        if landed.runner_output.sampling_masks:
            _land_sampling_masks(updated, landed.runner_output.sampling_masks)
        if tables:
            self._read_routing(updated, tables)
        self._after_update(landed, updated)
        dead_ended = [r for r in updated if r.is_dead_ended]
        if dead_ended:
            raise self._end_dead_ended(dead_ended, updated)
        return updated

    def _block_tables(self, scheduler_output: SchedulerOutput) -> dict[str, list[int]]:
        """The block tables of the step's requests, taken before the update may free them."""
        if self._routed_experts is None:
            return {}
        manager = self.scheduler.kv_cache_manager
        return {r.request_id: manager.get_block_ids(r.request_id)
                for r in scheduler_output.scheduled_requests}

    def _read_routing(self, updated: list[Request], tables: dict[str, list[int]]) -> None:
        """The routing of every position but the last (not computed yet) of the requests that
        finished, and of streams, read through their block tables now, while no later step has
        written those blocks; a stream reads only its rows new since the last step."""
        streams = self.output_processor.streams
        for request in updated:
            if request.request_id in tables and (
                    request.is_finished or streams(request.request_id)):
                request.routed_experts = self._routed_experts.read_new(
                    request.routed_experts, tables[request.request_id], request.num_tokens - 1)

    def land_all(self) -> None:
        """Land every step in flight (before memory changes under them); their outputs, and
        the "abort" outputs of prompts a failed step ended, come from the next `step()`."""
        while self.executor.num_in_flight:
            try:
                updated = self.land()
            except Exception as exc:  # noqa: BLE001 - its prompts are ended; the call goes on
                logger.warning("a step in flight failed (%s: %s); its prompts were ended",
                               type(exc).__name__, exc)
                continue
            self.pending_outputs += self.output_processor.outputs(updated, self._weight_version())

    def _fail(
        self, scheduler_outputs: Sequence[SchedulerOutput], exc: BaseException
    ) -> BaseException:
        """Fault safety: the failed step's prompts are ended cleanly, with those of the steps
        launched after it (async scheduling).

        The steps leave no trace that could be read later: the ledger's positions for them
        are freed with the requests' blocks, and no block they wrote entered the prefix cache
        (blocks are cached only after the step writing them completes). The same happens
        offline and in the server. KeyboardInterrupt and other BaseExceptions are re-raised
        as they are, with `request_ids` set on them.
        """
        child_ids = [
            r.request_id for output in scheduler_outputs for r in output.scheduled_requests
        ]
        group_ids = self.output_processor.group_ids_of(child_ids)
        self._end_prompts(group_ids)
        for scheduler_output in scheduler_outputs:
            self.scheduler.discard_step(scheduler_output)
        return step_error(exc, group_ids)

    def _end_dead_ended(
        self, dead_ended: list[Request], updated: list[Request]
    ) -> GrammarDeadEndError:
        """Structured outputs: the prompts of requests whose constraint allowed no token of the
        vocabulary end (their other samples too), with an error naming only them; the step's
        outputs, theirs included, come from the next `step()`."""
        group_ids = self.output_processor.group_ids_of(r.request_id for r in dead_ended)
        self.pending_outputs += self.output_processor.outputs(updated, self._weight_version())
        self._end_prompts(group_ids)
        logger.warning("ending %d prompts whose constraint dead-ended", len(group_ids))
        return dead_end_error(dead_ended[0], group_ids, self._vocab_size)


def _land_sampling_masks(updated: list[Request], masks: dict[str, list]) -> None:
    """Each updated request's masks, one per token it committed (`return_sampling_mask`)."""
    for request in updated:
        if request.request_id in masks:
            request.append_sampling_masks(masks[request.request_id])
