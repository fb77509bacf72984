"""The model, data and optimizers shared by the torch API test and its worker processes."""
import torch

STEPS = 6


def make_model() -> torch.nn.Module:
    # 300x200 weight (240 KB) is a whole key; the biases are small (batched keys)
    return torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.Tanh(), torch.nn.Linear(200, 3))


def make_optimizer(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=1e-3)
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-2)
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)
    raise ValueError(name)


def batches():
    gen = torch.Generator().manual_seed(7)
    for _ in range(STEPS):
        yield torch.randn(8, 300, generator=gen), torch.randn(8, 3, generator=gen)
