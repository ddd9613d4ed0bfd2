"""Corpus entries written the way research scripts are: one file of model code with its own config
dataclass, hand-rolled layers and the habits such code has, written here (not copied from any
project), small (64 wide, 4 blocks, batch 8) with seeded random weights and seeded inputs.

* ``script-nanogpt``: a nanoGPT-style GPT: a ``transformer`` ``nn.ModuleDict`` of token and learned
  position embeddings, a (zero) dropout, an ``nn.ModuleList`` of pre-norm blocks and a final norm;
  LayerNorm with an optional bias; one ``c_attn`` Linear split into q, k and v; causal
  ``F.scaled_dot_product_attention``; a GELU MLP; the output head tied to the token embedding;
  ``forward(idx, targets)`` returning ``(logits, loss)``; batches cut at random offsets from one long
  token stream (``get_batch``).
* ``script-vit``: a ViT on 8 images of 3 x 32 x 32: a strided Conv2d patch embedding, a class token
  and learned positions (65 tokens, an odd length), blocks in an ``nn.Sequential`` whose attention is
  written out (``q @ k^T``, softmax, ``@ v``) from a qkv Linear reshaped and permuted at once, the
  class token's features classified; the loss a label-smoothed ``nn.CrossEntropyLoss`` module held
  by a training-step wrapper, as a training loop holds its criterion.
* ``script-resnet-bn``: a small ResNet: a conv stem, four residual blocks in an ``nn.Sequential``
  (Conv-BatchNorm-ReLU, one strided with a 1x1 projection shortcut), global average pooling and a
  linear classifier; BatchNorm updates its running statistics in every training forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from meshfold.tools.corpus.catalog import Built, Entry, register, seeded

BATCH = 8
CLASSES = 10

# -- nanoGPT-style GPT -------------------------------------------------------------------------


@dataclass
class GPTConfig:
    """The GPT's hyperparameters, as a script's config dataclass holds them."""

    block_size: int = 16
    vocab_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = True


class LayerNorm(nn.Module):
    """LayerNorm whose bias can be switched off (``nn.LayerNorm`` could not, in older torch)."""

    def __init__(self, width: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.bias = nn.Parameter(torch.zeros(width)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention from one fused projection."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, steps, width = x.size()
        # one matmul for all three, then cut the channels into q, k, v and each into heads
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        heads = (batch, steps, self.n_head, width // self.n_head)
        q, k, v = (t.view(heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(batch, steps, width)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """The 4x-wide GELU feed-forward."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """A pre-norm transformer block."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """The language model: ``forward(idx, targets)`` returns ``(logits, loss)`` (the loss ``None``
    and only the last position's logits without targets, as when sampling)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # the head and the token embedding share one matrix
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        # residual projections start smaller, by the depth (two per block)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        _, t = idx.size()
        assert t <= self.config.block_size, f"sequence of {t} is longer than the block size {self.config.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def get_batch(config: GPTConfig, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``BATCH`` windows of ``block_size`` tokens at random offsets into one token stream, and the
    same windows one token later (the targets)."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, config.vocab_size, (1024,), generator=g)
    ix = torch.randint(len(data) - config.block_size, (BATCH,), generator=g)
    x = torch.stack([data[i : i + config.block_size] for i in ix])
    y = torch.stack([data[i + 1 : i + 1 + config.block_size] for i in ix])
    return x, y


def _nanogpt() -> Built:
    config = GPTConfig()
    return seeded(lambda: GPT(config)), get_batch(config)


# -- ViT ---------------------------------------------------------------------------------------


@dataclass
class ViTConfig:
    """The ViT's hyperparameters."""

    image_size: int = 32
    patch_size: int = 4
    channels: int = 3
    dim: int = 64
    depth: int = 4
    heads: int = 4
    mlp_ratio: float = 2.0
    num_classes: int = CLASSES


class Attention(nn.Module):
    """Softmax attention over all tokens, written out: scores, softmax, weighted values."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        attn = (q @ k.transpose(-2, -1)) * self.scale
        attn = attn.softmax(dim=-1)
        x = (attn @ v).transpose(1, 2).reshape(b, n, c)
        return self.proj(x)


class EncoderBlock(nn.Module):
    """A pre-norm encoder block: attention, then a GELU MLP, each on a residual."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float) -> None:
        super().__init__()
        hidden = int(dim * mlp_ratio)
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    """Patches and a class token through an encoder; the class token's features are classified."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        num_patches = (cfg.image_size // cfg.patch_size) ** 2
        self.patch_embed = nn.Conv2d(cfg.channels, cfg.dim, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches + 1, cfg.dim))
        self.blocks = nn.Sequential(*[EncoderBlock(cfg.dim, cfg.heads, cfg.mlp_ratio) for _ in range(cfg.depth)])
        self.norm = nn.LayerNorm(cfg.dim, eps=1e-6)
        self.head = nn.Linear(cfg.dim, cfg.num_classes)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.constant_(m.bias, 0)
        elif isinstance(m, nn.LayerNorm):
            nn.init.constant_(m.bias, 0)
            nn.init.constant_(m.weight, 1.0)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2)  # (B, patches, dim)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        x = torch.cat((cls, x), dim=1) + self.pos_embed
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])


class TrainStep(nn.Module):
    """A classifier with the criterion its training loop applies: ``forward(images, labels)`` is the
    loss of ``net(images)``."""

    def __init__(self, net: nn.Module, criterion: nn.Module) -> None:
        super().__init__()
        self.net = net
        self.criterion = criterion

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = self.criterion(self.net(images), labels)
        return loss


def images(seed: int = 0, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """``BATCH`` random 3 x ``size`` x ``size`` images and their labels below ``CLASSES``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, 3, size, size, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)


def _vit() -> Built:
    net = seeded(lambda: TrainStep(VisionTransformer(ViTConfig()), nn.CrossEntropyLoss(label_smoothing=0.1)))
    return net, images()


# -- ResNet with BatchNorm ----------------------------------------------------------------------


class BasicBlock(nn.Module):
    """Two 3x3 Conv-BatchNorm layers on a residual; a strided block projects its shortcut with a 1x1
    Conv-BatchNorm."""

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """A conv stem, residual blocks, global average pooling and a linear classifier."""

    def __init__(self, widths: tuple[int, ...] = (32, 64, 64, 64), num_classes: int = CLASSES) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        blocks, planes = [], widths[0]
        for width in widths:
            blocks.append(BasicBlock(planes, width, stride=2 if width != planes else 1))
            planes = width
        self.layers = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(planes, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layers(out)
        out = torch.flatten(self.pool(out), 1)
        return self.fc(out)


def _resnet() -> Built:
    return seeded(lambda: TrainStep(ResNet(), nn.CrossEntropyLoss())), images()


register(
    Entry(
        "script-nanogpt",
        "decoder",
        "ours (nanoGPT-style script)",
        _nanogpt,
        frozenset({"attention", "stack", "deep", "tokens"}),
        loss=lambda out: out[1],
        note="ModuleDict transformer with a ModuleList of blocks, fused c_attn split into q/k/v, causal SDPA, "
        "learned positions, LayerNorm with bias, tied head, forward returns (logits, loss)",
    )
)
register(
    Entry(
        "script-vit",
        "encoder",
        "ours (ViT-style script)",
        _vit,
        frozenset({"attention", "stack", "deep"}),
        note="Conv2d patch embedding, class token + learned positions (65 tokens), hand-written softmax "
        "attention from a permuted qkv, blocks in an nn.Sequential, label-smoothed CrossEntropyLoss module",
    )
)
register(
    Entry(
        "script-resnet-bn",
        "cnn",
        "ours (ResNet-style script)",
        _resnet,
        frozenset({"stack", "deep", "running-stats"}),
        note="BatchNorm2d, residual blocks in an nn.Sequential (one strided, 1x1 projection shortcut), "
        "global average pooling",
    )
)
