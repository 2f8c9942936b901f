"""Tests of trl_ext.losses.supervised against explicit loops written with `math`."""

import math

import pytest
import torch

from trl_ext.losses import get_loss, get_loss_spec
from trl_ext.losses.supervised import gpt_lm_loss, kd_loss, prm_loss

NAN, INF = float("nan"), float("inf")


def log_softmax_list(row, temperature=1.0):
    row = [x / temperature for x in row]
    m = max(row)
    lse = m + math.log(sum(math.exp(x - m) for x in row))
    return [x - lse for x in row]


def sig(x):
    return 1.0 / (1.0 + math.exp(-x))


# ---------------------------------------------------------------------------------------------------------- GPT-LM

LOGITS = [
    [[0.1, 0.5, -0.3], [1.0, 0.0, 0.2], [0.3, 0.3, 2.0], [-1.0, 0.4, 0.0]],
    [[0.0, 0.0, 0.0], [2.0, -1.0, 0.5], [0.2, 1.5, -0.5], [0.7, 0.1, 0.9]],
]
LABELS = [[0, 2, -100, 1], [-100, -100, 1, 0]]


def _lm_inputs():
    logits = torch.tensor(LOGITS, dtype=torch.float64)
    # garbage where the (shifted) target is ignored: row 0 positions 1 and 3, row 1 positions 0 and 3
    logits[0, 1] = NAN
    logits[0, 3] = INF
    logits[1, 0] = -INF
    logits[1, 3] = NAN
    return logits.requires_grad_(True), torch.tensor(LABELS)


def _lm_expected(shift=True):
    nlls, per_row, correct = [], [], 0
    for b in range(2):
        row = []
        for pos in range(4 - int(shift)):
            y = LABELS[b][pos + int(shift)]
            if y == -100:
                continue
            lp = log_softmax_list(LOGITS[b][pos])
            row.append(-lp[y])
            correct += max(range(3), key=lambda v, p=pos, bb=b: LOGITS[bb][p][v]) == y
        nlls += row
        per_row.append(row)
    return nlls, per_row, correct


def test_gpt_lm_loss_matches_loop_and_ignores_garbage():
    logits, labels = _lm_inputs()
    copies = (logits.detach().clone(), labels.clone())
    out = gpt_lm_loss(logits, labels)
    nlls, _, correct = _lm_expected()
    assert out.loss.item() == pytest.approx(sum(nlls) / len(nlls))
    assert out.metrics["num_tokens"].item() == 4
    assert out.metrics["token_accuracy"].item() == pytest.approx(correct / 4)
    out.loss.backward()
    assert torch.isfinite(logits.grad).all()
    assert logits.grad[0, 1].abs().sum().item() == 0.0 and logits.grad[1, 3].abs().sum().item() == 0.0
    torch.testing.assert_close(logits.detach(), copies[0], equal_nan=True, rtol=0, atol=0)
    assert torch.equal(labels, copies[1])


def test_gpt_lm_loss_aggregation_seq_mean():
    logits, labels = _lm_inputs()
    _, per_row, _ = _lm_expected()
    out = gpt_lm_loss(logits, labels, aggregation="seq-mean-token-mean")
    assert out.loss.item() == pytest.approx(sum(sum(r) / len(r) for r in per_row) / 2)


def test_gpt_lm_loss_normalizer_micro_batches():
    logits, labels = _lm_inputs()
    full = gpt_lm_loss(logits, labels).loss
    parts = [gpt_lm_loss(logits[i : i + 1], labels[i : i + 1], normalizer=4).loss for i in range(2)]
    assert (parts[0] + parts[1]).item() == pytest.approx(full.item())


def test_gpt_lm_loss_without_shift():
    logits = torch.tensor(LOGITS, dtype=torch.float64)
    labels = torch.tensor([[2, -100, 0, -100], [1, 1, -100, -100]])
    out = gpt_lm_loss(logits, labels, shift=False)
    expected = []
    for b in range(2):
        for pos in range(4):
            y = labels[b, pos].item()
            if y != -100:
                expected.append(-log_softmax_list(LOGITS[b][pos])[y])
    assert out.loss.item() == pytest.approx(sum(expected) / len(expected))


def test_gpt_lm_loss_all_ignored_is_zero_with_grad():
    logits = torch.randn(2, 3, 5, requires_grad=True)
    out = gpt_lm_loss(logits, torch.full((2, 3), -100))
    assert out.loss.item() == 0.0
    out.loss.backward()
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum().item() == 0.0


def test_gpt_lm_loss_shape_error():
    with pytest.raises(ValueError, match="logits"):
        gpt_lm_loss(torch.randn(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))


# -------------------------------------------------------------------------------------------------------------- KD

STUDENT = [[[0.1, 0.5, -0.3], [1.0, 0.0, 0.2]], [[0.3, 0.3, 2.0], [-1.0, 0.4, 0.0]]]
TEACHER = [[[0.4, -0.2, 0.0], [0.0, 0.0, 1.0]], [[1.0, 0.1, 0.2], [0.5, 0.5, 0.5]]]


def _kd_loop(valid, temperature=1.0):
    total, n = 0.0, 0
    for b in range(2):
        for pos in range(2):
            if not valid[b][pos]:
                continue
            ls = log_softmax_list(STUDENT[b][pos], temperature)
            lt = log_softmax_list(TEACHER[b][pos], temperature)
            total += sum(math.exp(a) * (a - c) for a, c in zip(lt, ls))
            n += 1
    return total / n


def test_kd_zero_for_equal_logits():
    logits = torch.tensor(STUDENT, dtype=torch.float64, requires_grad=True)
    out = kd_loss(logits, logits.detach().clone(), torch.ones(2, 2, dtype=torch.bool))
    assert abs(out.loss.item()) < 1e-12
    out.loss.backward()
    assert logits.grad.abs().max().item() < 1e-12


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_kd_matches_loop_with_labels_or_mask(temperature):
    valid = [[True, False], [True, True]]
    student = torch.tensor(STUDENT, dtype=torch.float64, requires_grad=True)
    teacher = torch.tensor(TEACHER, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([[4, -100], [0, 7]])
    expected = _kd_loop(valid, temperature)
    assert expected > 0
    out = kd_loss(student, teacher, labels=labels, temperature=temperature)
    assert out.loss.item() == pytest.approx(expected)
    assert out.metrics["num_tokens"].item() == 3
    mask = torch.tensor(valid)
    assert kd_loss(student, teacher, mask, temperature=temperature).loss.item() == pytest.approx(expected)
    assert kd_loss(student, teacher, mask.float(), temperature=temperature).loss.item() == pytest.approx(expected)
    assert kd_loss(student, teacher, mask.long(), temperature=temperature).loss.item() == pytest.approx(expected)
    out.loss.backward()
    assert teacher.grad is None  # the teacher is a constant
    assert student.grad[0, 1].abs().sum().item() == 0.0


def test_kd_ignores_garbage_and_handles_teacher_minus_inf():
    student = torch.tensor(STUDENT, dtype=torch.float64)
    teacher = torch.tensor(TEACHER, dtype=torch.float64)
    student[0, 1] = NAN
    teacher[0, 1] = INF
    teacher[1, 0, 2] = -INF  # a token outside the teacher's support
    student.requires_grad_(True)
    copies = (student.detach().clone(), teacher.clone())
    out = kd_loss(student, teacher, torch.tensor([[1.0, 0.0], [1.0, 1.0]]))
    # loop: with the -inf logit that token has p_t = 0 and contributes nothing
    total = 0.0
    for b, pos in [(0, 0), (1, 0), (1, 1)]:
        ls = log_softmax_list(STUDENT[b][pos])
        trow = TEACHER[b][pos][:2] if (b, pos) == (1, 0) else TEACHER[b][pos]
        lt = log_softmax_list(trow)
        total += sum(math.exp(a) * (a - c) for a, c in zip(lt, ls))
    assert out.loss.item() == pytest.approx(total / 3)
    out.loss.backward()
    assert torch.isfinite(student.grad).all()
    torch.testing.assert_close(student.detach(), copies[0], equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(teacher, copies[1], equal_nan=True, rtol=0, atol=0)


def test_kd_bad_options():
    s = torch.randn(2, 2, 3)
    with pytest.raises(ValueError, match="temperature"):
        kd_loss(s, s, torch.ones(2, 2, dtype=torch.bool), temperature=0.0)
    with pytest.raises(ValueError, match="teacher_logits"):
        kd_loss(s, torch.randn(2, 2, 4), torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="exactly one"):
        kd_loss(s, s, torch.ones(2, 2), labels=torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="exactly one"):
        kd_loss(s, s)


# ------------------------------------------------------------------------------------------------------------- PRM

PH, PLUS, MINUS = 2, 3, 4
INPUT_IDS = [[1, 2, 1, 2], [2, 0, 0, 0]]


def _prm_logits():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4, 5, generator=g, dtype=torch.float64)
    logits[0, 0] = NAN  # not a step marker: never read
    logits[1, 2] = INF
    # step markers: (0,1) predicts '+', (0,3) predicts '-', (1,0) predicts '+'
    logits[0, 1, [PLUS, MINUS]] = torch.tensor([1.0, -0.5], dtype=torch.float64)
    logits[0, 3, [PLUS, MINUS]] = torch.tensor([0.2, 0.9], dtype=torch.float64)
    logits[1, 0, [PLUS, MINUS]] = torch.tensor([0.4, 0.1], dtype=torch.float64)
    return logits.requires_grad_(True)


MARKER_LOGITS = [(1.0, -0.5), (0.2, 0.9), (0.4, 0.1)]


def test_prm_hard_labels():
    logits = _prm_logits()
    labels = torch.tensor([[-100, PLUS, -100, PLUS], [MINUS, -100, -100, -100]])
    out = prm_loss(logits, torch.tensor(INPUT_IDS), labels, placeholder_token_id=PH, reward_token_ids=[PLUS, MINUS])
    targets = [0, 0, 1]
    expected = sum(-log_softmax_list(list(lg))[y] for lg, y in zip(MARKER_LOGITS, targets)) / 3
    assert out.loss.item() == pytest.approx(expected)
    assert out.metrics["accuracy"].item() == pytest.approx(1 / 3)  # only the first marker is right
    assert out.metrics["num_steps"].item() == 3
    out.loss.backward()
    assert torch.isfinite(logits.grad).all()
    assert logits.grad[0, 1, 0].item() == 0.0  # only the reward tokens' logits are trained


def test_prm_hard_labels_ignore_and_unknown():
    logits = _prm_logits()
    ids = torch.tensor(INPUT_IDS)
    labels = torch.tensor([[-100, PLUS, -100, -100], [MINUS, -100, -100, -100]])
    out = prm_loss(logits, ids, labels, placeholder_token_id=PH, reward_token_ids=[PLUS, MINUS])
    expected = (-log_softmax_list([1.0, -0.5])[0] - log_softmax_list([0.4, 0.1])[1]) / 2
    assert out.loss.item() == pytest.approx(expected)
    assert out.metrics["num_steps"].item() == 2
    bad = torch.tensor([[-100, PLUS, -100, 1], [MINUS, -100, -100, -100]])
    with pytest.raises(ValueError, match="reward_token_ids"):
        prm_loss(logits, ids, bad, placeholder_token_id=PH, reward_token_ids=[PLUS, MINUS])


def test_prm_soft_labels():
    logits = _prm_logits()
    labels = torch.tensor([[-100.0, 0.8, -100.0, 0.3], [1.0, -100.0, -100.0, -100.0]], dtype=torch.float64)
    out = prm_loss(logits, torch.tensor(INPUT_IDS), labels, placeholder_token_id=PH, reward_token_ids=(PLUS, MINUS))
    expected = 0.0
    for (a, b), p in zip(MARKER_LOGITS, [0.8, 0.3, 1.0]):
        lp = log_softmax_list([a, b])
        expected += -(p * lp[0] + (1 - p) * lp[1])
    assert out.loss.item() == pytest.approx(expected / 3)
    # predictions: '+', '-', '+' ; labelled classes: '+', '-', '+'
    assert out.metrics["accuracy"].item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="exactly 2"):
        prm_loss(logits, torch.tensor(INPUT_IDS), labels, placeholder_token_id=PH, reward_token_ids=[0, PLUS, MINUS])


def test_prm_scalar_head_bce():
    logits = torch.tensor([[NAN, 0.5, INF, -1.0], [2.0, NAN, 0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([[-100.0, 1.0, -100.0, 0.25], [0.0, -100.0, -100.0, -100.0]])
    out = prm_loss(logits, torch.tensor(INPUT_IDS), labels, placeholder_token_id=PH)
    expected = 0.0
    for x, y in [(0.5, 1.0), (-1.0, 0.25), (2.0, 0.0)]:
        expected += -(y * math.log(sig(x)) + (1 - y) * math.log(1 - sig(x)))
    assert out.loss.item() == pytest.approx(expected / 3)
    assert out.metrics["accuracy"].item() == pytest.approx(2 / 3)  # the last marker (logit 2, label 0) is wrong
    out.loss.backward()
    assert torch.isfinite(logits.grad).all()
    # (B, T, 1) logits are accepted too
    out2 = prm_loss(logits.detach().unsqueeze(-1), torch.tensor(INPUT_IDS), labels, placeholder_token_id=PH)
    assert out2.loss.item() == pytest.approx(expected / 3)


def test_prm_errors():
    ids = torch.tensor(INPUT_IDS)
    labels = torch.full((2, 4), -100)
    with pytest.raises(ValueError, match="placeholder"):
        prm_loss(
            _prm_logits(),
            torch.zeros(2, 4, dtype=torch.long),
            labels,
            placeholder_token_id=PH,
            reward_token_ids=[3, 4],
        )
    with pytest.raises(ValueError, match="reward_token_ids"):
        prm_loss(_prm_logits(), ids, labels, placeholder_token_id=PH)


def test_prm_all_markers_ignored_is_zero_with_grad():
    logits = _prm_logits()
    out = prm_loss(
        logits, torch.tensor(INPUT_IDS), torch.full((2, 4), -100), placeholder_token_id=PH, reward_token_ids=[3, 4]
    )
    assert out.loss.item() == 0.0
    out.loss.backward()
    assert torch.isfinite(logits.grad).all()


# --------------------------------------------------------------------------------------------------------- registry


@pytest.mark.parametrize(
    "name, fn", [("gpt_lm", gpt_lm_loss), ("sft", gpt_lm_loss), ("kd", kd_loss), ("prm", prm_loss)]
)
def test_registry(name, fn):
    assert get_loss(name, kind="supervised") is fn
    assert get_loss_spec(name).kind == "supervised"
