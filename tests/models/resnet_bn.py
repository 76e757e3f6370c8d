"""A small ResNet (the BasicBlock design: conv-BN-ReLU-conv-BN plus the identity, a strided 1x1
conv + BN where the shape changes) in training mode: every BatchNorm2d normalises with the
batch's statistics and updates its running mean, variance and batch count during forward."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    def __init__(self, width=8, classes=10):
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(width)
        self.layer1 = nn.Sequential(Block(width, width, 1), Block(width, width, 1))
        self.layer2 = Block(width, 2 * width, 2)
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x, y):
        x = F.relu(self.bn(self.stem(x)))
        x = self.layer2(self.layer1(x))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return F.cross_entropy(self.fc(x), y)


def build_model(width=8):
    return ResNet(width)


def example_batch(batch_size, width=8):
    return torch.randn(batch_size, 3, 8, 8), torch.randint(0, 10, (batch_size,))
