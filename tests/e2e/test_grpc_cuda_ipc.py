"""Weight updates through CUDA IPC handles, from tensors on the server's GPU (gpu only)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.e2e.server_process import AUTH_TOKEN, start_server
from tests.integration.hf_oracle import hf_greedy
from trainer_bridge import EngineClient, SamplingParams

pytestmark = pytest.mark.gpu

PROMPT = [3, 14, 15, 92, 65]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def cuda_client(tmp_path_factory, llama_dir):
    process = start_server(tmp_path_factory, llama_dir, "--device", "cuda", "--dtype", "float32",
                           "--auth-token", AUTH_TOKEN)
    with EngineClient(process.address, auth_token=AUTH_TOKEN, timeout=120) as client:
        client.wait_until_ready(60)
        yield client
    assert process.stop() == 0, process.log()[-3000:]


@pytest.mark.parametrize(("transport", "seed"), [("cuda_ipc", 1), ("auto", 2), ("shm", 1)])
def test_update_from_cuda_tensors(cuda_client, other_model_dirs, transport, seed):
    weights = {k: v.cuda() for k, v in load_file(str(other_model_dirs[seed] / "model.safetensors"))
               .items()}
    version = cuda_client.info().weight_version
    cuda_client.sleep(level=2)
    cuda_client.wake_up(["weights"])
    # Small buckets: several buckets per update, so the two shared buffers are reused.
    assert cuda_client.update_weights(weights, transport=transport, bucket_bytes=64 * 1024) == (
        version + 1
    )
    cuda_client.wake_up(["kv_cache"])
    (output,) = cuda_client.generate([PROMPT], GREEDY)
    assert output.outputs[0].token_ids == hf_greedy(str(other_model_dirs[seed]), PROMPT, 8)
    torch.cuda.synchronize()
