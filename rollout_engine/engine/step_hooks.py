"""The host work around a step (DESIGN "The step loop"): structured outputs, KV transfers and
n-gram drafting, each hung on a named point of schedule -> launch -> land -> update."""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from rollout_engine.engine.step_failures import stall_error

if TYPE_CHECKING:
    from rollout_engine.core.request import Request
    from rollout_engine.core.scheduler import Scheduler
    from rollout_engine.core.scheduler_output import SchedulerOutput
    from rollout_engine.core.spec_decode import SpecDecoder
    from rollout_engine.engine.input_processor import InputProcessor
    from rollout_engine.engine.kv_connector import EngineKVConnector
    from rollout_engine.engine.output_processor import OutputProcessor
    from rollout_engine.engine.step_executor import LandedStep
    from rollout_engine.worker.model_runner import PreparedStep

logger = logging.getLogger(__name__)


class StepHooks:
    """Called by `LLMEngine.step()`: before scheduling, after it, beside the forward, after a
    step's tokens are committed, and when nothing could run. Ends prompts through `abort`
    (the engine's)."""

    def __init__(
        self,
        scheduler: Scheduler,
        processor: InputProcessor,
        output_processor: OutputProcessor,
        kv_connector: EngineKVConnector | None,
        drafter: SpecDecoder | None,
        abort: Callable[[list[str]], None],
    ) -> None:
        self.scheduler = scheduler
        self.processor = processor
        self.output_processor = output_processor
        self.kv_connector = kv_connector
        self.drafter = drafter
        self._abort = abort

    def before_schedule(self) -> None:
        """End requests whose constraint failed to compile; write the KV transfers that arrived
        (prefill-decode disaggregation)."""
        if self.processor.uses_grammars:
            failed = self.scheduler.requests_with_failed_grammars()
            if failed:  # compiling their constraint failed: they end as "abort"
                logger.warning("ending %d requests whose constraint failed to compile", len(failed))
                self._abort(self.output_processor.group_ids_of(failed))
        if self.kv_connector is not None:
            self.kv_connector.land_loads()

    def after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        """Time the requests scheduled for the first time; start the KV transfers the step
        asked for."""
        self.output_processor.stats.on_scheduled(scheduler_output.new_requests)
        if scheduler_output.kv_loads:
            self.kv_connector.start(scheduler_output.kv_loads)

    def beside_forward(
        self, scheduler_output: SchedulerOutput, prepared: concurrent.futures.Future[PreparedStep]
    ) -> Callable[[PreparedStep], None]:
        """The host work to overlap the step's forward: the token bitmask of its constrained
        requests (structured outputs), which its sampling waits on."""
        grammars = self.scheduler.grammars_of(scheduler_output)
        if grammars is not None and prepared.exception() is None:
            # Before the launch: a forward on another thread must find it and wait at sampling.
            prepared.result().token_bitmask = concurrent.futures.Future()
        return lambda step: self._compute_bitmask(step, grammars)

    def _compute_bitmask(self, prepared: PreparedStep, grammars) -> None:
        if prepared.token_bitmask is None:
            return
        try:
            prepared.token_bitmask.set_result(self.processor.grammars().bitmask(grammars))
        except BaseException as exc:  # noqa: BLE001 - the step fails with it
            prepared.token_bitmask.set_exception(exc)

    def after_update(self, landed: LandedStep, updated: list[Request]) -> None:
        """After a step's tokens are committed (to `updated`): save the KV of finished
        prefills for a remote decode, and draft the next step's tokens (speculation)."""
        if self.kv_connector is not None:
            self.kv_connector.save_finished_prefills()
        if self.drafter is not None:
            self.drafter.record(landed.scheduler_output, landed.runner_output, updated)
            drafts = self.drafter.propose(
                self.scheduler.requests_to_draft(), self.scheduler.num_running_requests
            )
            self.scheduler.update_draft_token_ids(drafts)

    def wait_for_progress(self) -> None:
        """Nothing could be scheduled, launched or landed: wait (bounded) for a grammar to
        compile or a KV transfer to arrive; anything else is a stall (a bug), which ends every
        prompt rather than leave one waiting forever."""
        compiling = self.scheduler.compiling_grammars()
        if compiling:
            compiling[0].wait(timeout_s=0.05)
            return
        if self.kv_connector is not None and self.kv_connector.wait_for_loads(0.05):
            return
        stuck = self.output_processor.group_ids
        self._abort(stuck)
        raise stall_error(stuck)
