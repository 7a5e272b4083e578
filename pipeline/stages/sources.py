"""Dataset sources as recipe stages: lazy sample sets with a content identity."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field

from ..data.dataset import DatasetValue
from ..data.sampleset import SampleSet
from ..data.sources import cifar10, cifar100, digits, fashion_mnist, image_folder, synthetic
from ..spec import DATASET
from ..stage import Stage, StageCall

if TYPE_CHECKING:
    from ..context import RunContext


class SourceStage(Stage):
    kind: ClassVar[str] = DATASET

    def load_sets(self) -> dict[str, SampleSet]:
        raise NotImplementedError

    def run(self, ctx: RunContext, inputs: dict[str, Any], call: StageCall) -> DatasetValue:
        sets = self.load_sets()
        first = next(iter(sets.values()))
        return DatasetValue(sets, list(first.class_names))


class Digits(SourceStage):
    """scikit-learn's bundled 8x8 digits (1797 samples): the embedded default, no download."""

    type_name: ClassVar[str] = "digits"

    def load_sets(self) -> dict[str, SampleSet]:
        return digits()


class FashionMNIST(SourceStage):
    """The four idx .gz files from Debian's dataset-fashion-mnist (found automatically) or ``root``."""

    type_name: ClassVar[str] = "fashion_mnist"
    root: str | None = None
    download: bool = False
    fingerprint_exclude: ClassVar[frozenset[str]] = frozenset({"root", "download"})

    def load_sets(self) -> dict[str, SampleSet]:
        return fashion_mnist(root=self.root, download=self.download)


class ImageFolder(SourceStage):
    """Class-per-folder JPEG/PNG trees; identity is content, so moving the folder keeps the cache."""

    type_name: ClassVar[str] = "image_folder"
    root: str
    on_bad_sample: Literal["fail", "skip"] = "fail"
    fingerprint_exclude: ClassVar[frozenset[str]] = frozenset({"root"})

    def load_sets(self) -> dict[str, SampleSet]:
        return dict(image_folder(self.root, on_bad_sample=self.on_bad_sample))

    def bad_sample_rule(self) -> str:
        return str(self.on_bad_sample)


class Cifar10(SourceStage):
    """CIFAR-10 from a torchvision root folder; never downloads unless ``download: true``."""

    type_name: ClassVar[str] = "cifar10"
    root: str
    download: bool = False
    fingerprint_exclude: ClassVar[frozenset[str]] = frozenset({"root", "download"})

    def load_sets(self) -> dict[str, SampleSet]:
        return cifar10(self.root, download=self.download)


class Cifar100(Cifar10):
    """CIFAR-100 from a torchvision root folder; never downloads unless ``download: true``."""

    type_name: ClassVar[str] = "cifar100"

    def load_sets(self) -> dict[str, SampleSet]:
        return cifar100(self.root, download=self.download)


class Synthetic(SourceStage):
    """Random class-dependent images of any size, generated on demand (for benchmarks)."""

    type_name: ClassVar[str] = "synthetic"
    num_samples: int = Field(1000, ge=1)
    num_classes: int = Field(10, ge=1)
    size: int = Field(32, ge=1)
    channels: Literal[1, 3] = 3
    seed: int = 0

    def load_sets(self) -> dict[str, SampleSet]:
        return synthetic(
            self.num_samples, self.num_classes, self.size, channels=self.channels, seed=self.seed
        )
