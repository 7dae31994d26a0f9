"""CIFAR-scale convolutional networks (32x32 inputs): the paper's ResNet-18 with a 3x3 stem, He et al.'s
ResNet-20/32/56, the pre-activation bottleneck ResNet-164, DenseNet-121 with a CIFAR stem and WRN-28-10.

Every nonlinearity is an ``nn.ReLU`` module and every shortcut an addition, so compression methods see
each layer as a module."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin, cout, stride=1, shortcut="conv"):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu2 = nn.ReLU(inplace=True)
        self.shortcut = None
        self.pad = 0
        if stride != 1 or cin != cout:
            if shortcut == "conv":
                self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            else:  # He et al.'s option A: subsample and pad channels with zeros (no parameters)
                self.pad = cout - cin
        self.stride = stride

    def forward(self, x):
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.shortcut is not None:
            identity = self.shortcut(x)
        elif self.pad:
            identity = F.pad(x[:, :, :: self.stride, :: self.stride], (0, 0, 0, 0, self.pad // 2, self.pad - self.pad // 2))
        else:
            identity = x
        return self.relu2(out + identity)


class CifarResNet(nn.Module):
    """ResNet for 32x32 inputs: 3x3 stem, no max-pool. ``widths`` per stage, ``blocks`` per stage."""

    def __init__(self, blocks, widths, num_classes=10, shortcut="conv"):
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU(inplace=True)
        stages, cin = [], widths[0]
        for i, (n, w) in enumerate(zip(blocks, widths)):
            layers = []
            for j in range(n):
                layers.append(BasicBlock(cin, w, 2 if (i > 0 and j == 0) else 1, shortcut))
                cin = w
            stages.append(nn.Sequential(*layers))
        self.layers = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        x = self.layers(self.relu(self.bn1(self.conv1(x))))
        return self.fc(torch.flatten(self.pool(x), 1))


class PreActBottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin, planes, stride=1):
        super().__init__()
        cout = planes * 4
        self.bn1, self.relu1 = nn.BatchNorm2d(cin), nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(cin, planes, 1, bias=False)
        self.bn2, self.relu2 = nn.BatchNorm2d(planes), nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn3, self.relu3 = nn.BatchNorm2d(planes), nn.ReLU(inplace=True)
        self.conv3 = nn.Conv2d(planes, cout, 1, bias=False)
        self.shortcut = nn.Conv2d(cin, cout, 1, stride, bias=False) if (stride != 1 or cin != cout) else None

    def forward(self, x):
        out = self.relu1(self.bn1(x))
        identity = self.shortcut(out) if self.shortcut is not None else x
        out = self.conv1(out)
        out = self.conv2(self.relu2(self.bn2(out)))
        out = self.conv3(self.relu3(self.bn3(out)))
        return out + identity


class _PreActHead(nn.Module):
    """Shared tail of pre-activation networks: final batch norm, ReLU, global pool, classifier."""

    def forward(self, x):
        x = self.relu(self.bn(self.layers(self.conv1(x))))
        return self.fc(torch.flatten(self.pool(x), 1))


class PreActResNet164(_PreActHead):
    """He et al. (2016b) pre-activation ResNet-164: 3 stages of 18 bottlenecks, widths 16/32/64 (x4)."""

    def __init__(self, num_classes=10, depth=164):
        super().__init__()
        n = (depth - 2) // 9
        self.conv1 = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
        stages, cin = [], 16
        for i, planes in enumerate((16, 32, 64)):
            layers = []
            for j in range(n):
                layers.append(PreActBottleneck(cin, planes, 2 if (i > 0 and j == 0) else 1))
                cin = planes * 4
            stages.append(nn.Sequential(*layers))
        self.layers = nn.Sequential(*stages)
        self.bn, self.relu = nn.BatchNorm2d(cin), nn.ReLU(inplace=True)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)


class DenseLayer(nn.Module):
    def __init__(self, cin, growth):
        super().__init__()
        self.bn1, self.relu1 = nn.BatchNorm2d(cin), nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(cin, 4 * growth, 1, bias=False)
        self.bn2, self.relu2 = nn.BatchNorm2d(4 * growth), nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(4 * growth, growth, 3, 1, 1, bias=False)

    def forward(self, x):
        out = self.conv2(self.relu2(self.bn2(self.conv1(self.relu1(self.bn1(x))))))
        return torch.cat([x, out], 1)


class Transition(nn.Sequential):
    def __init__(self, cin, cout):
        super().__init__(nn.BatchNorm2d(cin), nn.ReLU(inplace=True), nn.Conv2d(cin, cout, 1, bias=False),
                         nn.AvgPool2d(2))


class CifarDenseNet(_PreActHead):
    """DenseNet-BC (Huang et al.) with a 3x3 CIFAR stem; densenet121 = blocks (6, 12, 24, 16), growth 32."""

    def __init__(self, blocks=(6, 12, 24, 16), growth=32, reduction=0.5, num_classes=10):
        super().__init__()
        c = 2 * growth
        self.conv1 = nn.Conv2d(3, c, 3, 1, 1, bias=False)
        stages = []
        for i, n in enumerate(blocks):
            layers = []
            for _ in range(n):
                layers.append(DenseLayer(c, growth))
                c += growth
            stages.append(nn.Sequential(*layers))
            if i < len(blocks) - 1:
                cout = int(c * reduction)
                stages.append(Transition(c, cout))
                c = cout
        self.layers = nn.Sequential(*stages)
        self.bn, self.relu = nn.BatchNorm2d(c), nn.ReLU(inplace=True)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c, num_classes)


class WideBlock(nn.Module):
    def __init__(self, cin, cout, stride, dropout):
        super().__init__()
        self.bn1, self.relu1 = nn.BatchNorm2d(cin), nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn2, self.relu2 = nn.BatchNorm2d(cout), nn.ReLU(inplace=True)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.shortcut = nn.Conv2d(cin, cout, 1, stride, bias=False) if (stride != 1 or cin != cout) else None

    def forward(self, x):
        out = self.relu1(self.bn1(x))
        identity = self.shortcut(out) if self.shortcut is not None else x
        out = self.conv2(self.dropout(self.relu2(self.bn2(self.conv1(out)))))
        return out + identity


class WideResNet(_PreActHead):
    """Zagoruyko & Komodakis WRN-depth-k; wrn28_10 = depth 28, widen 10."""

    def __init__(self, depth=28, widen=10, dropout=0.0, num_classes=10):
        super().__init__()
        n = (depth - 4) // 6
        widths = [16] + [int(round(b * widen)) for b in (16, 32, 64)]
        self.conv1 = nn.Conv2d(3, widths[0], 3, 1, 1, bias=False)
        stages, cin = [], widths[0]
        for i, w in enumerate(widths[1:]):
            stages.append(nn.Sequential(*[WideBlock(cin if j == 0 else w, w, (1 if i == 0 else 2) if j == 0 else 1,
                                                    dropout) for j in range(n)]))
            cin = w
        self.layers = nn.Sequential(*stages)
        self.bn, self.relu = nn.BatchNorm2d(cin), nn.ReLU(inplace=True)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)
