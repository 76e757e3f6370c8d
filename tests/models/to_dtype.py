import torch


class Net(torch.nn.Module):
    def __init__(self, convert):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8) if convert else torch.nn.Linear(8, 8, dtype=torch.bfloat16)
        if convert:
            self.fc.to(torch.bfloat16)  # converting after construction

    def forward(self, x):
        return self.fc(x).float().pow(2).mean()


def build_model(convert=True):
    return Net(convert)


def example_batch(batch_size, convert=True):
    return (torch.randn(batch_size, 8, dtype=torch.bfloat16),)
