"""When an engine process spreads over a process per GPU (jinfer/parallel/local_group.py): decided from the
configuration and the environment, before JAX starts."""

import pytest

from jinfer.config.engine import EngineConfig
from jinfer.parallel.local_group import one_process_per_gpu, visible_gpus

from ..conftest import DATA

GPUS2 = {"CUDA_VISIBLE_DEVICES": "0,1"}


def test_visible_gpus():
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 3"}) == ["2", "3"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,1", "JAX_PLATFORMS": "cpu"}) == []
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-abc", "JAX_PLATFORMS": "cuda,cpu"}) == ["GPU-abc"]


@pytest.mark.parametrize("fields,env,spread", [
    (dict(tensor_parallel_size=2), GPUS2, True),  # auto on two GPUs
    (dict(tensor_parallel_size=2), {"CUDA_VISIBLE_DEVICES": "0"}, False),  # fewer GPUs than tp
    (dict(tensor_parallel_size=2), {"JAX_PLATFORMS": "cpu"}, False),  # no GPU
    (dict(tensor_parallel_size=1), GPUS2, False),
    (dict(tensor_parallel_size=2, distributed_executor_backend="uni"), GPUS2, False),
    (dict(tensor_parallel_size=2, distributed_executor_backend="mp"), {"JAX_PLATFORMS": "cpu"}, True),  # forced
    (dict(tensor_parallel_size=2, nnodes=2), GPUS2, False),  # the user's own group
    (dict(tensor_parallel_size=2, data_parallel_size=2), GPUS2, False),  # replicas: one process each
    (dict(tensor_parallel_size=2, kv_offload_gb=1.0), GPUS2, False),  # what a group refuses: one process
    (dict(tensor_parallel_size=2, speculative_config={"method": "mtp", "num_speculative_tokens": 1}), GPUS2, False),
    (dict(tensor_parallel_size=2, speculative_config='{"method": "ngram", "num_speculative_tokens": 2}'), GPUS2,
     True),
    (dict(tensor_parallel_size=2, runner="pooling"), GPUS2, False),
])
def test_one_process_per_gpu(fields, env, spread):
    assert one_process_per_gpu(EngineConfig(model=str(DATA / "tiny-qwen3"), **fields), env) is spread


def test_mp_with_what_a_group_refuses_names_the_field():
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        EngineConfig(model=None, distributed_executor_backend="mp", data_parallel_size=2)
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        EngineConfig(model=None, distributed_executor_backend="processes")
