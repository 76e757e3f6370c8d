import torch


def example_batch(batch_size):
    return (torch.randn(batch_size, 4),)
