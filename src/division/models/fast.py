"""A fast CIFAR-10 network in the style of Keller Jordan's airbench94 (94 % in about 10 epochs), written for this
framework: a frozen 2x2 convolution that whitens the input (its filters come from the eigenvectors of the
covariance of 2x2 patches of training images), then three groups of conv -> max-pool -> BN -> GELU -> conv ->
BN -> GELU, a max-pool over the last 3x3 map and a linear head scaled down by 1/9.

Choices that make it fast to train: identity (Dirac) initialisation of each convolution's first in-channels
filters, batch norms whose weights stay frozen at 1 (only their biases train, at a higher learning rate: see
``optim.bias_lr_scale``), and a whitened input.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


class BatchNorm(nn.BatchNorm2d):
    """Batch norm with its weight frozen at 1 (a bias-only affine), airbench's momentum and epsilon."""

    def __init__(self, channels: int, momentum: float = 0.4, eps: float = 1e-12):
        super().__init__(channels, eps=eps, momentum=momentum)
        self.weight.requires_grad_(False)


class Conv(nn.Conv2d):
    """3x3 'same' convolution without bias, the first in-channels filters initialised as the identity."""

    def __init__(self, channels_in: int, channels_out: int):
        super().__init__(channels_in, channels_out, kernel_size=3, padding="same", bias=False)

    def reset_parameters(self):
        super().reset_parameters()
        w = self.weight.data
        torch.nn.init.dirac_(w[:w.size(1)])


class ConvGroup(nn.Module):
    def __init__(self, channels_in: int, channels_out: int):
        super().__init__()
        self.conv1 = Conv(channels_in, channels_out)
        self.pool = nn.MaxPool2d(2)
        self.norm1 = BatchNorm(channels_out)
        self.act1 = nn.GELU()
        self.conv2 = Conv(channels_out, channels_out)
        self.norm2 = BatchNorm(channels_out)
        self.act2 = nn.GELU()

    def forward(self, x):
        x = self.act1(self.norm1(self.pool(self.conv1(x))))
        return self.act2(self.norm2(self.conv2(x)))


class Fast94Net(nn.Module):
    """Input 3x32x32 -> whiten (24x31x31) -> groups of width ``widths`` (15, 7, 3) -> max-pool -> linear."""

    def __init__(self, num_classes: int = 10, widths=(64, 256, 256), scale: float = 1 / 9,
                 whiten_bias_epochs: int = 3):
        super().__init__()
        self.whiten_bias_epochs = whiten_bias_epochs
        self.whiten = nn.Conv2d(3, 24, kernel_size=2, padding=0, bias=True)
        self.whiten.weight.requires_grad_(False)
        self.act = nn.GELU()
        self.layers = nn.Sequential(ConvGroup(24, widths[0]), ConvGroup(widths[0], widths[1]),
                                    ConvGroup(widths[1], widths[2]))
        self.pool = nn.MaxPool2d(3)
        self.head = nn.Linear(widths[2], num_classes, bias=False)
        self.scale = scale

    def start_epoch(self, epoch: int):
        """The whitening bias trains for the first ``whiten_bias_epochs`` epochs only (as airbench94)."""
        self.whiten.bias.requires_grad_(epoch < self.whiten_bias_epochs)
        if epoch >= self.whiten_bias_epochs:
            self.whiten.bias.grad = None

    def forward(self, x):
        x = self.layers(self.act(self.whiten(x)))
        return self.head(torch.flatten(self.pool(x), 1)) * self.scale

    @torch.no_grad()
    def init_from_data(self, images: torch.Tensor, eps: float = 5e-4):
        """Whitening filters from normalised training images (N, 3, 32, 32): the covariance of all 2x2
        patches, its eigenvectors scaled by 1/sqrt(eigenvalue + eps), each with its negative (24 filters)."""
        h, w = self.whiten.weight.shape[2:]
        patches = images.float().unfold(2, h, 1).unfold(3, w, 1).transpose(1, 3).reshape(-1, 3 * h * w)
        patches = patches - patches.mean(0)
        cov = patches.t() @ patches / len(patches)
        eigenvalues, eigenvectors = torch.linalg.eigh(cov.double())
        filters = (eigenvectors.t() / torch.sqrt(eigenvalues.view(-1, 1) + eps)).float()
        filters = filters.flip(0).view(-1, 3, h, w)  # largest eigenvalue first; patches were (c, h, w)
        self.whiten.weight.copy_(torch.cat([filters, -filters]).to(self.whiten.weight))
        self.whiten.bias.zero_()
