"""Models for examples and benchmarks, written here because torchvision is not importable beside
the CPU torch build this project installs (its compiled ops do not match).

``resnet18`` is the CIFAR-style ResNet-18 (He et al. 2016): a 3×3 stem, four stages of two basic
blocks, 62 parameter tensors and 11.2 M weights; ``in_channels=1`` takes the digits images.
``LSTMLanguageModel`` is a word-level 2-layer LSTM language model (Zaremba et al. 2014, medium:
650 units, vocabulary 10000; 19.8 M weights, most of them in the embedding and the decoder).
"""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, blocks=(2, 2, 2, 2), num_classes: int = 10, in_channels: int = 3, width: int = 64) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        layers, cin = [], width
        for i, n in enumerate(blocks):
            cout = width * 2 ** i
            for j in range(n):
                layers.append(BasicBlock(cin, cout, 2 if (j == 0 and i > 0) else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def resnet18(num_classes: int = 10, in_channels: int = 1, width: int = 64) -> ResNet:
    """CIFAR-style ResNet-18; defaults fit scikit-learn's 8×8 digits (1 channel, 10 classes)."""
    return ResNet((2, 2, 2, 2), num_classes, in_channels, width)


class LSTMLanguageModel(nn.Module):
    """Word-level LSTM language model, like Zaremba et al. 2014's medium PTB model (SAFusion's LSTM).

    Embedding (``vocab`` × ``embed``, dense gradients: ``sparse=False``, so every step sends the
    whole table like the paper's runs), ``layers`` stacked ``nn.LSTM`` layers of ``hidden`` units
    with dropout between them and on the embedding and LSTM outputs, and a linear decoder back to
    ``vocab`` logits. At vocab 10000 and 650 units the embedding (6.5 M) and the decoder (6.5 M)
    hold two thirds of the 19.8 M weights, so the gradient traffic is dominated by two large
    tensors whose rows are mostly zero (embedding) or small: the case sparsification targets.
    ``tie_weights`` shares the embedding and decoder matrices (needs ``embed == hidden``).

    Input: (batch, seq) token ids; output: (batch, seq, vocab) logits. The LSTM starts from a
    zero state each call (no hidden state carried across batches; enough for throughput).
    Weights are initialised uniformly in [-0.05, 0.05] as in Zaremba's medium model.
    """

    def __init__(self, vocab: int = 10000, embed: int = 650, hidden: int = 650, layers: int = 2,
                 dropout: float = 0.5, tie_weights: bool = False) -> None:
        super().__init__()
        if tie_weights and embed != hidden:
            raise ValueError(f"tie_weights needs embed == hidden, got {embed} and {hidden}")
        self.encoder = nn.Embedding(vocab, embed)
        self.drop = nn.Dropout(dropout)
        self.lstm = nn.LSTM(embed, hidden, layers, dropout=dropout if layers > 1 else 0.0, batch_first=True)
        self.decoder = nn.Linear(hidden, vocab)
        if tie_weights:
            self.decoder.weight = self.encoder.weight
        for p in self.parameters():
            nn.init.uniform_(p, -0.05, 0.05)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.drop(self.encoder(tokens)))
        return self.decoder(self.drop(out))
