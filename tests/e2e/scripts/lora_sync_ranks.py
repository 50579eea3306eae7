"""Run under `accelerate launch` (gloo on CPU): every rank builds a LoRA GRPO trainer with its
own engine, syncs once, and checks that its engine serves the merged weights."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
from accelerate import PartialState
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig

from tests.e2e.test_trl_backend import GREEDY_PROMPTS, NUM_GREEDY_TOKENS, engine_greedy, hf_greedy
from trainer_bridge import EngineClient
from trainer_bridge.server_process import EngineServer
from trainer_bridge.trl import EngineGRPOTrainer


def main(model_dir: str, out: str) -> None:
    state = PartialState(cpu=True)
    torch.manual_seed(0)  # the same adapter on every rank, as DDP requires
    lora = LoraConfig(r=8, lora_alpha=32, target_modules=["q_proj", "v_proj", "gate_proj"],
                      init_lora_weights=False)
    with EngineServer(model_dir, engine_options={"kv_cache_bytes": "8MiB"},
                      log_path=Path(out) / f"engine-rank{state.process_index}.log") as server:
        client = EngineClient(server.address, timeout=60)
        trainer = EngineGRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
            reward_funcs=lambda completion_ids, **kw: [0.0] * len(completion_ids),
            args=GRPOConfig(output_dir=str(Path(out) / "trainer"), per_device_train_batch_size=4,
                            num_generations=4, max_completion_length=8, report_to="none",
                            use_cpu=True, bf16=False, disable_tqdm=True),
            train_dataset=Dataset.from_dict({"prompt": ["a b c"] * 8}),
            processing_class=AutoTokenizer.from_pretrained(model_dir), engine=client,
            peft_config=lora,
        )
        trainer.sync_engine_weights()
        model = trainer.accelerator.unwrap_model(trainer.model)
        expected = hf_greedy(copy.deepcopy(model).merge_and_unload(), GREEDY_PROMPTS,
                             NUM_GREEDY_TOKENS)
        with model.disable_adapter():
            base_only = hf_greedy(model, GREEDY_PROMPTS, NUM_GREEDY_TOKENS)
        served = engine_greedy(client)
        print(f"rank {state.process_index}: served merged {served == expected}, "
              f"adapter matters {expected != base_only}", flush=True)
        client.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
