"""Vision transformers (swin_t, vit_b_16) as block lists: structure, weights, cuts, token maps, meter."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.models as tvm

from pipeline.codec.features import DequantizedStream
from pipeline.codec.moves import CropFlip, crop_and_flip
from pipeline.codec.quantile import quantize
from pipeline.context import RunContext
from pipeline.deploy.model_file import load_model
from pipeline.errors import ModelError, StageError
from pipeline.models.fold import fold_batch_norms
from pipeline.models.memory import footprint
from pipeline.models.weights import apply_weights, load_weights
from pipeline.models.zoo import BlockNet, build_backbone, feature_shape, split_at, token_layout
from pipeline.recipe import recipe_from_dict
from pipeline.runner import Runner
from pipeline.spec import STREAM, Cut, FieldSpec, Quantization, Spec, SplitSpec
from pipeline.stages.feature_aug import FeatureAugment
from stores.catalog import Catalog

# Small inputs keep these nets affordable on a 2-core CPU: ViT's grid is 2x2 at 32 px; Swin pads
# every stage to whole 7x7 windows whatever the size.
RES = {"swin_t": 32, "vit_b_16": 32}
TORCHVISION = {"swin_t": lambda: tvm.swin_t(weights=None, num_classes=7),
               "vit_b_16": lambda: tvm.vit_b_16(weights=None, num_classes=7, image_size=32)}


@pytest.fixture(scope="module")
def nets() -> dict[str, BlockNet]:
    out = {}
    for arch, res in RES.items():
        torch.manual_seed(0)
        out[arch] = build_backbone(arch, 7, resolution=res).eval()
    return out


@pytest.mark.parametrize("arch", sorted(RES))
def test_every_parameter_is_in_exactly_one_block_or_the_head(nets: dict[str, BlockNet], arch: str) -> None:
    net = nets[arch]
    owners: dict[int, list[str]] = {}
    parts = [(f"blocks.{i}", b) for i, b in enumerate(net.blocks)] + [("head", net.head)]
    for name, part in parts:
        for p in part.parameters():
            owners.setdefault(id(p), []).append(name)
    assert all(len(v) == 1 for v in owners.values())
    assert set(owners) == {id(p) for p in net.parameters()}
    reference = TORCHVISION[arch]()
    assert sum(p.numel() for p in net.parameters()) == sum(p.numel() for p in reference.parameters())


@pytest.mark.parametrize("arch", sorted(RES))
def test_torchvision_state_dict_file_loads_through_the_renames(nets: dict[str, BlockNet], arch: str,
                                                               tmp_path: Path) -> None:
    torch.manual_seed(1)
    reference = TORCHVISION[arch]().eval()
    if arch == "vit_b_16":  # torchvision zeroes ViT's classifier: give it weights that show in the logits
        torch.nn.init.normal_(reference.heads.head.weight, std=0.02)
    path = tmp_path / f"{arch}.pt"
    torch.save(reference.state_dict(), path)  # a plain torchvision state_dict, as `weights: PATH` takes
    state, _meta = load_weights(path)
    torch.manual_seed(2)  # another initialisation: equality below proves the file was loaded
    net = build_backbone(arch, 7, resolution=RES[arch]).eval()
    x = torch.randn(2, 3, RES[arch], RES[arch])
    with torch.no_grad():
        expected = reference(x)
        assert not torch.allclose(net(x), expected, atol=1e-4)
        apply_weights(net, state, source=str(path))
        torch.testing.assert_close(net(x), expected, rtol=1e-5, atol=1e-5)


def test_block_structure_and_feature_shapes_at_cuts(nets: dict[str, BlockNet]) -> None:
    swin, vit = nets["swin_t"], nets["vit_b_16"]
    # Swin-T: patch embedding + 2 + 2 + 6 + 2 Swin blocks; merging starts a stage's first block.
    assert len(swin.blocks) == 13 and len(vit.blocks) == 13  # ViT: embedding + 12 encoder layers
    assert [i for i, b in enumerate(swin.blocks) if hasattr(b, "merge")] == [3, 5, 11]
    expected = {0: (768, 1, 1), 1: (768, 1, 1), 2: (384, 2, 2), 8: (192, 4, 4), 10: (96, 8, 8),
                12: (96, 8, 8), 13: (3, 32, 32)}
    for k, shape in expected.items():
        assert feature_shape(swin, k, 32) == shape
        assert token_layout(swin, k) is None
    assert feature_shape(swin, 10, 64) == (96, 16, 16)  # Swin takes any size (it pads)
    for k in (0, 1, 6, 12):  # ViT: the class token, then the 2x2 patch grid
        assert feature_shape(vit, k, 32) == (768, 1, 5)
        assert token_layout(vit, k) == (1, 2, 2)
    assert token_layout(vit, 13) is None  # nothing frozen: the images themselves


@pytest.mark.parametrize("arch,k", [("swin_t", 2), ("swin_t", 11), ("vit_b_16", 1)])
def test_cut_composes_to_the_full_forward(nets: dict[str, BlockNet], arch: str, k: int) -> None:
    net = nets[arch]
    bottom, top = split_at(net, k)
    x = torch.randn(2, 3, RES[arch], RES[arch])
    with torch.no_grad():
        features = bottom(x)
        assert tuple(features.shape[1:]) == feature_shape(net, k, RES[arch])
        torch.testing.assert_close(top(features), net(x))
    if arch == "vit_b_16":  # the class token sits first, the grid row by row after it
        with torch.no_grad():
            tokens = net.blocks[0](x)
            patches = net.blocks[0].conv_proj(x)  # (2, 768, 2, 2)
        pos = net.blocks[0].pos_embedding[0].T  # (768, 5)
        class_token = net.blocks[0].class_token[0, 0] + pos[:, 0]
        torch.testing.assert_close(tokens[:, :, 0, 0], class_token.expand(2, -1))
        torch.testing.assert_close(tokens[:, :, 0, 1:], patches.flatten(2) + pos[:, 1:])


def test_resolution_and_small_input_errors() -> None:
    with pytest.raises(ModelError, match="multiple of 16, found 40"):
        build_backbone("vit_b_16", 5, resolution=40)
    with pytest.raises(ModelError, match="swin_t is a transformer.*resolution"):
        build_backbone("swin_t", 5, small_input=True)
    torch.manual_seed(0)
    vit = build_backbone("vit_b_16", 5, resolution=16)
    with pytest.raises(ModelError, match=r"built for 16x16 inputs.*found 32x32"):
        feature_shape(vit, 1, 32)


@pytest.mark.parametrize("arch", sorted(RES))
def test_fold_batch_norms_is_a_no_op(nets: dict[str, BlockNet], arch: str) -> None:
    bottom, _ = split_at(nets[arch], 2)
    for p in bottom.parameters():
        p.requires_grad_(False)
    try:
        assert fold_batch_norms(bottom) is bottom  # LayerNorm only: nothing to fold, no copy made
    finally:
        for p in bottom.parameters():
            p.requires_grad_(True)


def _token_maps(n: int = 4, d: int = 3, h: int = 3, w: int = 4) -> torch.Tensor:
    return torch.arange(n * d * (1 + h * w), dtype=torch.float32).reshape(n, d, 1, 1 + h * w) + 1


def test_crop_and_flip_move_the_grid_and_leave_the_class_token() -> None:
    x = _token_maps()
    grid = (1, 3, 4)
    u = np.random.default_rng(0).random((4, 3))
    flipped = crop_and_flip(x, 0, 1.0, u, grid)  # always flip, no crop
    torch.testing.assert_close(flipped[..., 0], x[..., 0])
    as_grid = x[..., 1:].reshape(4, 3, 3, 4)
    torch.testing.assert_close(flipped[..., 1:].reshape(4, 3, 3, 4), as_grid.flip(-1))
    # A crop with padding: the grid moves as a (3, 4) map would, zeros where it was padded.
    cropped = crop_and_flip(x, 1, 0.5, u, grid)
    torch.testing.assert_close(cropped[..., 0], x[..., 0])
    plain = crop_and_flip(as_grid.contiguous(), 1, 0.5, u)
    torch.testing.assert_close(cropped[..., 1:].reshape(4, 3, 3, 4), plain)
    assert bool((plain == 0).any())  # the draw did pad somewhere, so the check above saw padding


def test_decoding_with_a_token_crop_equals_cropping_the_decoded_maps() -> None:
    x = torch.randn(5, 6, 1, 1 + 4 * 4)
    q = quantize(x.transpose(1, 3).contiguous().transpose(1, 3), 4)  # a strided view, as ViT's blocks give
    cut = Cut("vit_b_16", 1, None, (6, 1, 17), 64, token_layout=(1, 4, 4))
    fields = {"codes": FieldSpec((q.codes.shape[1],), "uint8"), "lo": FieldSpec((6,), "float16"),
              "scale": FieldSpec((6,), "float16"), "y": FieldSpec((), "int64"), "id": FieldSpec((), "int64")}
    spec = Spec(STREAM, 2, {"train": SplitSpec(5, fields)}).with_cut(cut)
    spec = spec.with_quantization(spec.splits, Quantization(4, 1, (6, 1, 17)))
    decoded = Spec(STREAM, 2, {"train": SplitSpec(5, {"x": FieldSpec((6, 1, 17), "float32")})},
                   dict(spec.meta))
    stream = DequantizedStream(None, decoded)  # type: ignore[arg-type]  # decode() reads no parent
    batch = {"codes": q.codes, "lo": q.lo, "scale": q.scale, "id": torch.arange(5)}
    crop = CropFlip.draw(5, 4, 4, 1, 0.5, np.random.default_rng(3).random((5, 3)), prefix=1)
    moved = stream.decode(batch, crop)["x"]
    torch.testing.assert_close(moved, crop.apply(stream.decode(batch)["x"]), rtol=0, atol=0)
    aug = FeatureAugment(input="deq", crop_padding=1)
    assert aug.resolve({"input": decoded}, None) is decoded
    assert decoded.feature_grid((6, 1, 17)) == (1, 4, 4)
    bad = Spec(STREAM, 2, {"train": SplitSpec(5, {"x": FieldSpec((6, 1, 16), "float32")})}, dict(spec.meta))
    with pytest.raises(StageError, match=r"token layout \(1 prefix token\(s\) \+ a 4x4 grid\)"):
        aug.resolve({"input": bad}, None)


@pytest.mark.parametrize("arch,k", [("swin_t", 2), ("vit_b_16", 1)])
def test_memory_meter_on_transformer_blocks(nets: dict[str, BlockNet], arch: str, k: int) -> None:
    """The analytic count (Linear/LayerNorm/GELU inputs, attention's q/k/v, probabilities and projection
    inputs) is within 10% of the saved tensors measured in a real training step."""
    net = nets[arch]
    _, top = split_at(net, k)
    fp = footprint(top, (2, *feature_shape(net, k, RES[arch])))
    assert fp.measured_bytes is not None
    assert 0.9 <= fp.measured_bytes / fp.activation_bytes <= 1.1
    attention = [layer for layer in fp.layers if "attention" in layer.reason]
    assert attention and all(layer.bytes > 0 for layer in attention)


def _digits_recipe(arch: str, resolution: int, train_last_blocks: int) -> dict:
    return {
        "name": f"{arch}_two_stage",
        "stages": {
            "digits": {"type": "digits"},
            "target": {"type": "split", "input": "digits", "classes": [5, 6, 7, 8, 9], "per_class": 6,
                       "val_fraction": 0.05, "test_fraction": 0.05},
            "backbone": {"type": "backbone", "arch": arch, "num_classes": 5, "resolution": resolution},
            "images": {"type": "decode", "input": "target", "resolution": resolution},
            "features": {"type": "frozen_forward", "input": "images", "model": "backbone",
                         "train_last_blocks": train_last_blocks},
            "q2": {"type": "quantize", "input": "features", "bits": 2},
            "cache": {"type": "cache", "input": "q2"},
            "deq": {"type": "dequantize", "input": "cache"},
            "aug": {"type": "feature_aug", "input": "deq", "crop_padding": 1, "hflip": 0.5},
            "top": {"type": "finetune", "model": "backbone", "features": "aug", "batch_size": 10,
                    "train": {"epochs": 1, "lr": 0.001}},
        },
        "targets": ["top"],
    }


@pytest.mark.slow
@pytest.mark.parametrize("arch,resolution,k,shape", [("swin_t", 16, 2, [384, 1, 1]),
                                                     ("vit_b_16", 32, 1, [768, 1, 5])])
def test_two_stage_from_a_2bit_cache(tmp_path: Path, arch: str, resolution: int, k: int,
                                     shape: list[int]) -> None:
    recipe = recipe_from_dict(_digits_recipe(arch, resolution, k))
    ctx = RunContext(catalog=Catalog(tmp_path / "store"), output_dir=tmp_path / "run")
    reports = {r.name: r for r in Runner(recipe, ctx).run()}
    assert reports["cache"].status == "computed" and reports["cache"].bytes_written > 0
    m = reports["top"].metrics
    assert m["mode"] == "two_stage" and m["bits"] == 2 and m["train_last_blocks"] == k
    assert 0.0 <= m["accuracy"] <= 1.0
    assert list(m["top_input_shape"]) == shape
    assert 0.9 <= m["memory_activation_bytes_measured"] / m["memory_activation_bytes"] <= 1.1
    # The trained model's file rebuilds the net (ViT at its resolution) and loads its weights.
    loaded = load_model(tmp_path / "run", stage="top")
    x = torch.randn(2, 3, resolution, resolution)
    with torch.no_grad():
        assert loaded(x).shape == (2, 5)
