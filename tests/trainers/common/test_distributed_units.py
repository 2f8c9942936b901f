"""In-process tests of the pieces that make N processes compute what one does (issue 18); the launched runs are in
`test_distributed_matrix.py` and `test_distributed_resume.py`.

- ``seed_per_row``: each row samples from a counter-based stream keyed by its global index (`rollout/sampling.py`):
  uniform, and a row's tokens do not depend on the rows that share its batch;
- statistics over every process's rows: PPO's advantage whitening (`masked_whiten(reduce=)`), the PPO / RePULSe
  metrics (`OnlineMetrics.pop(gather_object)`), the proposal's maxima;
- the value loss's ``clipfrac`` counts clipping, not rounding;
- FSDP's memory-saving load: weights left on the meta device get storage (`materialize_meta_parameters`);
- the recipes' engine names (`cli.engine_name`) and their clean end of a multi-process job (`cli.finish_distributed`).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from trl_ext.cli import engine_name, finish_distributed
from trl_ext.losses.ppo import clipped_value_loss
from trl_ext.ops import masked_whiten
from trl_ext.rollout import SamplingSettings, generate_responses
from trl_ext.rollout.sampling import SampleAndRecord, keyed_uniform, row_keys
from trl_ext.testing import build_causal_lm
from trl_ext.trainers.common.distributed import materialize_meta_parameters
from trl_ext.trainers.common.metrics import OnlineMetrics
from trl_ext.trainers.proposal.metrics import ProposalMetrics


# ---------------------------------------------------------------------------------------------- seed_per_row
def test_keyed_uniforms_are_uniform_distinct_and_device_independent():
    keys = row_keys(0, 0, 0, torch.arange(50_000))
    assert keys.unique().numel() == 50_000  # the hash is a bijection of the row index
    draws = torch.cat([keyed_uniform(keys, step) for step in range(4)]).flatten()
    assert 0.0 <= float(draws.min()) and float(draws.max()) < 1.0
    counts = torch.histc(draws.float(), bins=20, min=0.0, max=1.0)
    chi2 = float(((counts - counts.mean()) ** 2 / counts.mean()).sum())
    assert chi2 < 50, chi2  # 19 degrees of freedom: P(chi2 > 50) < 2e-4
    assert abs(float(draws.mean()) - 0.5) < 0.005
    # the same keys give the same numbers, other seeds / streams / rollouts other ones
    assert torch.equal(keyed_uniform(keys[:10], 3), keyed_uniform(keys, 3)[:10])
    for other in (
        row_keys(1, 0, 0, torch.arange(10)),
        row_keys(0, 1, 0, torch.arange(10)),
        row_keys(0, 0, 1, torch.arange(10)),
    ):
        assert not torch.equal(other, keys[:10])


def test_a_row_draws_the_same_token_whatever_rows_share_its_batch():
    logits = torch.randn(6, 50)
    keys = row_keys(7, 0, 3, torch.arange(6))
    together = SampleAndRecord(row_keys=keys)(torch.zeros(6, 1, dtype=torch.long), logits.clone()).argmax(-1)
    for rows in ([0, 1, 2], [3, 4, 5], [5], [4, 0]):
        alone = SampleAndRecord(row_keys=keys[rows])(torch.zeros(len(rows), 1, dtype=torch.long), logits[rows].clone())
        assert torch.equal(alone.argmax(-1), together[rows])


def test_keyed_generation_of_two_halves_equals_one_batch(tiny_tokenizer):
    """What two processes sample for their halves of a batch (rows keyed by global index) is what one samples."""
    model = build_causal_lm("gpt_neox", tokenizer=tiny_tokenizer).eval()
    ids = torch.randint(5, 200, (4, 5))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding, different per half
    settings = SamplingSettings(max_new_tokens=6, pad_token_id=tiny_tokenizer.pad_token_id, temperature=1.0)
    keys = row_keys(0, 0, 0, torch.arange(4))
    whole = generate_responses(model, ids, mask, settings, 4, row_keys=keys)[0]
    halves = [
        generate_responses(model, ids[s], mask[s], settings, 2, row_keys=keys[s])[0]
        for s in (slice(0, 2), slice(2, 4))
    ]
    width = whole.shape[1]
    pad = tiny_tokenizer.pad_token_id
    halves = [torch.nn.functional.pad(h, (0, width - h.shape[1]), value=pad) for h in halves]
    assert torch.equal(torch.cat(halves), whole)
    torch.manual_seed(123)  # torch's RNG is not used with keys
    assert torch.equal(generate_responses(model, ids, mask, settings, 4, row_keys=keys)[0], whole)


# ---------------------------------------------------------------------------------- statistics of every process
def _two_process_reduce(other_x: torch.Tensor, other_mask: torch.Tensor):
    """A ``reduce`` (sum over processes) as process 0 sees it when process 1 holds ``other_x`` / ``other_mask``:
    the first call sums ``[Σx, count]``, the second the squared deviations from the global mean."""
    calls = []

    def reduce(local: torch.Tensor) -> torch.Tensor:
        if not calls:
            other = torch.stack([(other_x * other_mask).sum(), other_mask.sum()])
            calls.append(local + other)
            return calls[-1]
        mean = calls[0][0] / calls[0][1]
        return local + ((other_x - mean) ** 2 * other_mask).sum()

    return reduce


def test_whitening_over_processes_equals_whitening_of_all_rows():
    x, mask = torch.randn(8, 5) * 3 + 1, (torch.rand(8, 5) > 0.3).float()
    whole = masked_whiten(x, mask)
    shard = masked_whiten(x[:4], mask[:4], reduce=_two_process_reduce(x[4:], mask[4:]))
    assert torch.allclose(shard, whole[:4], atol=1e-6)
    assert not torch.allclose(masked_whiten(x[:4], mask[:4]), whole[:4], atol=1e-3)  # its own share alone differs
    with pytest.raises(ValueError, match="dim=None"):
        masked_whiten(x, mask, dim=1, reduce=lambda t: t)


def test_ppo_metrics_average_every_process_and_take_the_largest_diff():
    metrics = OnlineMetrics()  # process 0's share; process 1's is given by the fake gather_object
    for key, value in (("loss/policy_avg", 1.0), ("objective/logprob_diff_first_step", 0.1), ("val/ratio", 1.1)):
        metrics.add(key, value)
    other = ({"loss/policy_avg": 3.0, "objective/logprob_diff_first_step": 0.4, "val/ratio": 1.4}, [1.4])
    logs = metrics.pop(gather_object=lambda share: [share[0], other])
    assert logs["loss/policy_avg"] == 2.0 and logs["objective/logprob_diff_first_step"] == 0.4
    assert logs["val/ratio"] == pytest.approx(1.25)
    assert logs["val/ratio_var"] == pytest.approx(0.0225)  # the variance of both processes' micro-batch ratios


def test_proposal_maxima_are_the_largest_over_processes():
    metrics = ProposalMetrics()
    every = torch.tensor([[0.9, 0.2, 5.0], [0.1, 0.4, 7.0]])  # two processes' max_weight, logprob_diff, ess
    metrics.add_many({"max_weight": 0.0, "logprob_diff": 0.0, "ess": 0.0}, "proposal/", gather=lambda t: every)
    logs = metrics.pop()
    assert logs == pytest.approx({"proposal/max_weight": 0.9, "proposal/logprob_diff": 0.4, "proposal/ess": 6.0})


# --------------------------------------------------------------------------------------------------- misc
def test_value_clipfrac_counts_clipping_not_rounding():
    old = torch.tensor([[0.15, 0.3, 10.0]])
    values = torch.tensor([[1e-9, 0.25, 10.5]])
    assert old[0, 0] + (values[0, 0] - old[0, 0]) != values[0, 0]  # float32 rounding: V_old + (V − V_old) = 0
    returns = torch.tensor([[1e-9, 0.0, 11.0]])
    out = clipped_value_loss(values, old, returns, torch.ones_like(values), cliprange_value=0.2)
    assert float(out.metrics["clipfrac"]) == pytest.approx(1 / 3)  # only the last entry moved by more than 0.2


def test_meta_parameters_get_storage_and_distinct_addresses():
    head = nn.Linear(4, 2, device="meta")
    model = nn.Sequential(nn.Linear(3, 4), head)
    names = materialize_meta_parameters(model)
    assert names == ["1.weight", "1.bias"]
    assert not any(p.is_meta for p in model.parameters())
    assert len({p.data_ptr() for p in model.parameters()}) == 4  # accelerate's FSDP2 remap keys on these
    assert model[1].weight.requires_grad and model[1].weight.device.type == "cpu"


@pytest.mark.parametrize(
    ("state", "processes", "expected"),
    [
        ({}, 1, "single process"),
        ({}, 2, "DDP"),
        ({"deepspeed_plugin": SimpleNamespace(zero_stage=3)}, 2, "DeepSpeed ZeRO-3"),
        ({"fsdp_plugin": SimpleNamespace(fsdp_version=2)}, 2, "FSDP2"),
    ],
)
def test_engine_names(state, processes, expected):
    accelerator = SimpleNamespace(state=SimpleNamespace(**state), num_processes=processes)
    assert engine_name(accelerator) == expected


class _RecordingState:
    """What `finish_distributed` calls on a `PartialState`, recorded; it destroys the real process group."""

    def __init__(self, num_processes):
        self.num_processes, self.calls = num_processes, []

    def wait_for_everyone(self):
        self.calls.append("wait_for_everyone")

    def destroy_process_group(self):
        self.calls.append("destroy_process_group")
        torch.distributed.destroy_process_group()


class _RecordingAccelerator(_RecordingState):
    """The same for an `Accelerator`, whose `end_training` also closes trackers."""

    def end_training(self):
        self.calls.append("end_training")
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize(
    ("kind", "end"), [(_RecordingAccelerator, "end_training"), (_RecordingState, "destroy_process_group")]
)
def test_finish_distributed_waits_then_destroys_the_process_group(kind, end, tmp_path, monkeypatch):
    from trl_ext import cli

    monkeypatch.setattr(cli, "_ENDED_DISTRIBUTED_JOB", False)  # restored afterwards: `exit_process` reads it
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        single = kind(1)
        finish_distributed(single)  # one process: nothing to tear down, the group is left alone
        assert single.calls == [] and torch.distributed.is_initialized() and not cli._ENDED_DISTRIBUTED_JOB
        job = kind(2)
        finish_distributed(job)
        assert job.calls == ["wait_for_everyone", end]
        assert not torch.distributed.is_initialized() and cli._ENDED_DISTRIBUTED_JOB
        finish_distributed(job)  # a second call (nothing left to destroy) is a no-op
        assert job.calls == ["wait_for_everyone", end]
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


_EXIT_SCRIPT = """
import atexit
from trl_ext import cli

class Finalized:
    def __del__(self):
        print("teardown ran", flush=True)

kept = Finalized()  # a module global: interpreter teardown finalizes it
atexit.register(lambda: print("atexit ran"))
cli.exit_process()  # no multi-process job ended here: it returns
print("returned")
if ENDED:
    cli._ENDED_DISTRIBUTED_JOB = True
    print("buffered", end="")  # still in stdout's buffer: exit_process must flush it
    cli.exit_process()
    print("not reached")
"""


@pytest.mark.parametrize("ended", [False, True])
def test_exit_process_skips_teardown_only_after_a_multi_process_job(ended):
    """`cli.exit_process` returns unless `finish_distributed` ended a multi-process job; then it runs the atexit
    handlers, flushes, and ends with status 0 before interpreter teardown (no finalizer runs)."""
    import subprocess
    import sys

    script = f"ENDED = {ended}\n{_EXIT_SCRIPT}"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if ended:
        assert proc.stdout == "returned\nbufferedatexit ran\n"
    else:
        assert proc.stdout == "returned\natexit ran\nteardown ran\n"
