"""Models outside the zoo that capture must also handle: conv + BatchNorm, LSTM/GRU, nn.Transformer,
bf16 with a tuple output."""

import torch, torch.nn as nn, torch.nn.functional as F


class CNN(nn.Module):
    def __init__(s):
        super().__init__()
        s.c1 = nn.Conv2d(3, 8, 3, padding=1)
        s.bn = nn.BatchNorm2d(8)
        s.c2 = nn.Conv2d(8, 8, 3, stride=2)
        s.fc = nn.Linear(8 * 3 * 3, 10)
        s.do = nn.Dropout(0.1)

    def forward(s, x, y):
        h = F.max_pool2d(F.relu(s.bn(s.c1(x))), 2)
        h = s.do(F.relu(s.c2(h)))
        h = F.adaptive_avg_pool2d(h, 3)
        return F.cross_entropy(s.fc(h.flatten(1)), y)


class RNN(nn.Module):
    def __init__(s):
        super().__init__()
        s.emb = nn.Embedding(50, 16)
        s.lstm = nn.LSTM(16, 32, batch_first=True)
        s.gru = nn.GRU(32, 16, batch_first=True)
        s.out = nn.Linear(16, 50)

    def forward(s, x, y):
        h, _ = s.lstm(s.emb(x))
        h, _ = s.gru(h)
        return F.cross_entropy(s.out(h).flatten(0, 1), y.flatten())


class TX(nn.Module):
    def __init__(s):
        super().__init__()
        s.emb = nn.Embedding(50, 32)
        s.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0), 2)
        s.head = nn.Linear(32, 50)

    def forward(s, x, y):
        return F.cross_entropy(s.head(s.enc(s.emb(x))).flatten(0, 1), y.flatten())


class TupleOut(nn.Module):
    def __init__(s):
        super().__init__()
        s.l = nn.Linear(8, 8).to(torch.bfloat16)

    def forward(s, x):
        h = s.l(x)
        return h.float().pow(2).mean(), h


def cnn():
    return CNN(), (torch.randn(2, 3, 12, 12), torch.randint(0, 10, (2,)))


def rnn():
    return RNN(), (torch.randint(0, 50, (2, 7)), torch.randint(0, 50, (2, 7)))


def tx():
    return TX(), (torch.randint(0, 50, (2, 7)), torch.randint(0, 50, (2, 7)))


def tup():
    return TupleOut(), (torch.randn(4, 8, dtype=torch.bfloat16),)
