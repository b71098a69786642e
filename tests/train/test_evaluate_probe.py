"""train/run/evaluation.py's linear probe against an independent fit of its objective: cross-entropy
on the standardised training features plus weight_decay times the sum of the squared weights (the
bias unpenalised), minimised by Newton's method in float64."""
import torch
import torch.nn.functional as F

from train.run.evaluation import linear_probe_top1


def newton_fit(train_f, train_y, test_f, classes, weight_decay, penalty):
    """The test logits of the head minimising CE + weight_decay * penalty(W) on features
    standardised by the training mean and std; the final gradient's norm says it converged."""
    mean, std = train_f.mean(0), train_f.std(0) + 1e-6
    xtr, xte = ((train_f - mean) / std).double(), ((test_f - mean) / std).double()
    d = xtr.shape[1]

    def objective(theta):
        weight, bias = theta[: classes * d].view(classes, d), theta[classes * d:]
        return F.cross_entropy(xtr @ weight.T + bias, train_y) + weight_decay * penalty(weight)

    theta = torch.zeros(classes * (d + 1), dtype=torch.float64)
    for _ in range(25):  # the softmax's common bias shift is flat: the pseudo-inverse leaves it alone
        gradient = torch.autograd.functional.jacobian(objective, theta)
        theta = theta - torch.linalg.pinv(torch.autograd.functional.hessian(objective, theta)) @ gradient
    converged = torch.autograd.functional.jacobian(objective, theta).norm().item()
    weight, bias = theta[: classes * d].view(classes, d), theta[classes * d:]
    return xte @ weight.T + bias, converged


def test_linear_probe_penalises_the_sum_of_the_squared_weights():
    """A weight decay of 1 on imbalanced data: the head pulled toward the class prior predicts
    what the independent fit of the same objective predicts, sample for sample (scored against
    those predictions: 100%). The penalty's scale matters here: the mean of the squared weights
    (8 times less) would predict other classes for some samples."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(400, 4, generator=g)
    y = (x[:, 0] > -0.6745).long()  # ~3/4 class 1
    logits, converged = newton_fit(x[:300], y[:300], x[300:], 2, 1.0, lambda w: w.pow(2).sum())
    assert converged < 1e-10
    margin = (logits[:, 1] - logits[:, 0]).abs().min().item()
    assert margin > 0.1  # no test sample near the boundary: an L-BFGS fit to tolerance predicts the same
    predicted = logits.argmax(1)
    averaged, _ = newton_fit(x[:300], y[:300], x[300:], 2, 1.0, lambda w: w.pow(2).mean())
    assert (averaged.argmax(1) != predicted).any()
    assert linear_probe_top1(x[:300], y[:300], x[300:], predicted, 2, weight_decay=1.0) == 100.0
