"""The model families NeuroFlux builds, by name.

Kept apart from :mod:`.models` (which needs torch and torchvision) so a recipe's
``arch`` is documented and checked where only the recipe tools are installed.
"""

# torchvision's VGG configuration letter for each depth (all with batch norm)
VGG_CONFIGS = {"vgg11": "A", "vgg16": "D", "vgg19": "E"}
# BasicBlocks per stage of the CIFAR-style ResNets
RESNET_STAGES = {"resnet18": (2, 2, 2, 2)}
ARCHS = (*VGG_CONFIGS, *RESNET_STAGES)
