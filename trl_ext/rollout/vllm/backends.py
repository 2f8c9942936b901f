"""The two vLLM engines a rollout can sample from, behind one small interface:

- ``generate(prompts, params, n)``: ``n`` completions per prompt (token ids) → per prompt, ``n`` pairs
  ``(completion_ids, logprobs)`` (vLLM's ``processed_logprobs``: of the distribution sampled from, temperature
  applied and, with top-k/top-p, renormalised over the kept tokens; without top-k/top-p the trainers' tempered
  log-probs);
- ``load_weights(named_tensors)``: put the trained weights into the engine.

:class:`ColocateEngine` is a `vllm.LLM` in the training process (in-process executor,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``), weights loaded in place with the model runner's ``reload_weights``.

:class:`ServerEngine` talks to a ``trl vllm-serve`` (``VLLM_SERVER_DEV_MODE=1 vllm serve ...``) server through TRL's
`trl.generation.vllm_client.VLLMClient`. Weights go over TRL's NCCL weight-transfer group when the trainer is on a
CUDA device; vLLM has no other transfer backend for a CPU trainer, so there the weights are written to a
safetensors folder that the server reads back through its dev endpoint ``/collective_rpc`` — which needs a file
system shared with the server (the same machine, or a shared mount). The method called is
``trl_ext_reload_weights`` of :class:`~.worker.WeightReloadExtension` (start the server with
``--worker-extension-cls trl_ext.rollout.vllm.worker.WeightReloadExtension``), else vLLM's own ``reload_weights``
with a warning: on a CPU server that one leaves a tied LM head stale (:mod:`.worker`).
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterable, Sequence

import torch

__all__ = ["ColocateEngine", "ServerEngine"]

logger = logging.getLogger(__name__)

Completions = list[list[tuple[list[int], list[float]]]]


class ColocateEngine:
    """A `vllm.LLM` in this process, fed token ids (no tokenizer: ``skip_tokenizer_init``). ``model_path``: a folder
    (or Hub id) with the policy's config; ``load_format="dummy"`` starts from random weights, replaced at the first
    :meth:`load_weights`."""

    def __init__(
        self,
        model_path: str,
        *,
        seed: int = 0,
        dtype: str = "auto",
        gpu_memory_utilization: float = 0.3,
        tensor_parallel_size: int = 1,
        max_model_len: int | None = None,
        enable_sleep_mode: bool = False,
        max_num_seqs: int = 256,
        enforce_eager: bool | None = None,
        load_format: str = "auto",
    ):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
        if not torch.cuda.is_available():
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU (vLLM's default: 4)
        from vllm import LLM

        self.enable_sleep_mode = enable_sleep_mode
        self.llm = LLM(
            model=model_path,
            seed=seed,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            max_model_len=max_model_len,
            enable_sleep_mode=enable_sleep_mode,
            max_num_seqs=max_num_seqs,
            enforce_eager=(not torch.cuda.is_available()) if enforce_eager is None else enforce_eager,
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=True,
            load_format=load_format,
            skip_tokenizer_init=True,
        )
        self._sleeping = False
        if enable_sleep_mode:
            self.llm.sleep(level=1)
            self._sleeping = True

    def _wake(self) -> None:
        if self._sleeping:
            self.llm.wake_up()
            self._sleeping = False

    def generate(self, prompts: Sequence[Sequence[int]], params: dict, n: int) -> Completions:
        from vllm import SamplingParams

        self._wake()
        sampling = SamplingParams(n=n, logprobs=0, detokenize=False, **params)
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sampling, use_tqdm=False)
        result = []
        for out in outputs:
            rows = []
            for c in out.outputs:
                ids = list(c.token_ids)
                lps = [step[t].logprob for t, step in zip(ids, c.logprobs or [])] if c.logprobs else [0.0] * len(ids)
                rows.append((ids, lps))
            result.append(rows)
        if self.enable_sleep_mode:
            self.llm.sleep(level=1)
            self._sleeping = True
        return result

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._wake()
        from .worker import refresh_tied_lm_head

        runner = self.llm.llm_engine.model_executor.driver_worker.worker.model_runner
        runner.reload_weights(weights_iterator=iter(named_tensors))
        refresh_tied_lm_head(runner.get_model())
        self.llm.reset_prefix_cache()
        if self.enable_sleep_mode:
            self.llm.sleep(level=1)
            self._sleeping = True


class ServerEngine:
    """A running ``trl vllm-serve`` server, through TRL's `VLLMClient` (see the module docs for weight sync).

    ``device``: the trainer's device (CUDA: NCCL weight transfer; otherwise the file + ``/collective_rpc`` path).
    ``weights_dir``: where the file path writes the weights (default: a fresh temporary folder)."""

    def __init__(
        self,
        base_url: str | None = None,
        host: str = "0.0.0.0",
        port: int = 8000,
        timeout: float = 240.0,
        group_port: int = 51216,
        device: torch.device | str = "cpu",
        weights_dir: str | None = None,
    ):
        from trl.generation.vllm_client import VLLMClient

        self.client = VLLMClient(
            base_url=base_url, host=host, server_port=port, group_port=group_port, connection_timeout=timeout
        )
        self.device = torch.device(device)
        self.weights_dir = weights_dir
        self._nccl = False
        self._reload_method = "trl_ext_reload_weights"

    def generate(self, prompts: Sequence[Sequence[int]], params: dict, n: int) -> Completions:
        params = dict(params)
        main = {k: params.pop(k) for k in ("temperature", "top_p", "top_k", "max_tokens") if k in params}
        out = self.client.generate(
            prompts=[list(p) for p in prompts], n=n, logprobs=0, repetition_penalty=1.0, min_p=0.0,
            generation_kwargs=params, **main,
        )  # fmt: skip
        completions, logprobs = out["completion_ids"], out["logprobs"]
        result = []
        for i in range(len(prompts)):
            rows = []
            for j in range(i * n, (i + 1) * n):
                lps = [step[0] for step in logprobs[j]] if logprobs is not None else [0.0] * len(completions[j])
                rows.append((list(completions[j]), lps))
            result.append(rows)
        return result

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.device.type == "cuda":
            self._load_weights_nccl(named_tensors)
        else:
            self._load_weights_file(named_tensors)
        self.client.reset_prefix_cache()

    def _load_weights_nccl(self, named_tensors) -> None:  # pragma: no cover - needs CUDA and a GPU server
        if not self._nccl:
            self.client.init_communicator(device=self.device)
            self._nccl = True
        tensors = [(name, t) for name, t in named_tensors]
        metadata = [(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in tensors]
        self.client.update_named_params(metadata, iter(tensors))

    def _load_weights_file(self, named_tensors) -> None:
        from safetensors.torch import save_file

        if self.weights_dir is None:
            self.weights_dir = tempfile.mkdtemp(prefix="trl_ext_vllm_weights_")
        os.makedirs(self.weights_dir, exist_ok=True)
        state = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in named_tensors}
        save_file(state, os.path.join(self.weights_dir, "model.safetensors"), metadata={"format": "pt"})
        url = f"{self.client.base_url}/collective_rpc"
        body = {"method": self._reload_method, "kwargs": {"weights_path": self.weights_dir}}
        response = self.client.session.post(url, json=body)
        if response.status_code not in (200, 404) and self._reload_method == "trl_ext_reload_weights":
            logger.warning(
                "The vLLM server at %s has no trl_ext worker extension (%s); reloading with vLLM's reload_weights, "
                "which leaves a tied LM head stale on a CPU server. Start it with --worker-extension-cls "
                "trl_ext.rollout.vllm.worker.WeightReloadExtension.",
                self.client.base_url,
                response.text[:200],
            )
            self._reload_method = "reload_weights"
            response = self.client.session.post(url, json={**body, "method": "reload_weights"})
        if response.status_code == 404:
            raise RuntimeError(
                f"The vLLM server at {self.client.base_url} has no /collective_rpc endpoint, which the CPU weight "
                "sync uses: start it with `trl vllm-serve` (or `VLLM_SERVER_DEV_MODE=1 vllm serve ...`)."
            )
        if response.status_code != 200:
            raise RuntimeError(f"Weight reload on the vLLM server failed: {response.status_code} {response.text}")
