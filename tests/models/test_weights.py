"""Weights files: hash identity, atomic safe save/load, readable mismatches, hub cache lookup."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from pipeline.errors import MissingPathError, ModelError
from pipeline.models.weights import apply_weights, hub_checkpoint, load_weights, save_weights, state_dict_hash
from pipeline.models.zoo import BlockNet, build_backbone


def tiny(num_classes: int = 5, seed: int = 0, arch: str = "mobilenet_v2") -> BlockNet:
    torch.manual_seed(seed)
    return build_backbone(arch, num_classes, width_mult=0.35 if arch == "mobilenet_v2" else 1.0,
                          small_input=True).eval()


def test_hash_is_stable_and_content_based() -> None:
    a, b = tiny(seed=3), tiny(seed=3)
    h = state_dict_hash(a)
    assert h == state_dict_hash(b) == state_dict_hash(a.state_dict())
    assert h == state_dict_hash({k: v.clone() for k, v in reversed(list(a.state_dict().items()))})
    assert h != state_dict_hash(tiny(seed=4))


def test_hash_changes_with_one_weight() -> None:
    net = tiny()
    before = state_dict_hash(net)
    with torch.no_grad():
        net.blocks[7].conv[0][0].weight.view(-1)[11] += 1e-6
    assert state_dict_hash(net) != before


@settings(max_examples=40, deadline=None)
@given(shape=st.lists(st.integers(0, 4), min_size=0, max_size=3), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool]))
def test_hash_sensitive_to_name_dtype_shape_bytes(shape: list[int], seed: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(shape, generator=g) * 10).to(dtype)
    base = state_dict_hash({"w": t})
    assert base == state_dict_hash({"w": t.clone()})
    assert base != state_dict_hash({"v": t})
    assert base != state_dict_hash({"w": t.reshape(-1, 1) if t.dim() != 2 else t.reshape(-1)})
    other = torch.float64 if dtype != torch.float64 else torch.float32
    assert base != state_dict_hash({"w": t.to(other)})
    if t.numel():
        changed = t.clone()
        flat = changed.view(-1)
        flat[0] = ~flat[0] if dtype == torch.bool else flat[0] + 1
        assert base != state_dict_hash({"w": changed})


def test_hash_ignores_memory_layout() -> None:
    t = torch.randn(3, 4)
    assert state_dict_hash({"w": t.t().contiguous().t()}) == state_dict_hash({"w": t})


def test_save_load_round_trip_with_weights_only(tmp_path: Path) -> None:
    net = tiny()
    meta = {"arch": "mobilenet_v2", "classes": ["a", "b"], "acc": 0.5, "nested": {"n": 1, "t": (1, 2)}}
    path = save_weights(net, tmp_path / "sub" / "w.pt", meta)
    state, got_meta = load_weights(path)
    assert state_dict_hash(state) == state_dict_hash(net)
    assert got_meta == meta
    raw = torch.load(path, weights_only=True)  # the safe loader accepts the file as is
    assert set(raw) == {"state_dict", "meta"}
    assert [p.name for p in path.parent.iterdir()] == ["w.pt"]  # no temp file left behind


def test_plain_state_dict_file_loads_with_empty_meta(tmp_path: Path) -> None:
    net = tiny()
    torch.save(net.state_dict(), tmp_path / "plain.pth")
    state, meta = load_weights(tmp_path / "plain.pth")
    assert meta == {} and state_dict_hash(state) == state_dict_hash(net)


def test_save_rejects_non_plain_metadata(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=r"meta\.when.*Path"):
        save_weights(tiny(), tmp_path / "w.pt", {"when": tmp_path})
    assert not list(tmp_path.iterdir())


def test_missing_file_error_names_path_and_remedy(tmp_path: Path) -> None:
    missing = tmp_path / "nope.pt"
    with pytest.raises(MissingPathError, match="nope.pt.*pretrain"):
        load_weights(missing)


def test_corrupt_file_is_a_model_error_naming_path(tmp_path: Path) -> None:
    path = save_weights(tiny(), tmp_path / "w.pt", {})
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ModelError, match="w.pt"):
        load_weights(path)
    with pytest.raises(ModelError, match="not a file"):
        load_weights(tmp_path)


class Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (print, ("code ran",))


def test_pickled_objects_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "evil.pt"
    torch.save({"state_dict": {"w": torch.zeros(1)}, "meta": Evil()}, path, pickle_module=pickle)
    with pytest.raises(ModelError, match="evil.pt"):
        load_weights(path)
    torch.save([torch.zeros(1)], tmp_path / "list.pt")
    with pytest.raises(ModelError, match="expected a state_dict"):
        load_weights(tmp_path / "list.pt")


def test_apply_weights_round_trip_and_classifier_skip() -> None:
    src, dst = tiny(num_classes=10, seed=1), tiny(num_classes=3, seed=2)
    x = torch.randn(2, 3, 32, 32)
    notes = apply_weights(dst, src.state_dict(), source="test")
    assert len(notes) == 1 and "head.classifier.1" in notes[0]
    own = dst.state_dict()
    for k, v in src.state_dict().items():
        if not k.startswith("head.classifier.1."):
            assert torch.equal(own[k], v)
    with pytest.raises(ModelError, match=r"shape mismatches: head\.classifier\.1\.\w+ \(10,"):
        apply_weights(dst, src.state_dict(), source="test", strict_head=True)
    same = tiny(num_classes=10, seed=5)
    assert apply_weights(same, src.state_dict(), source="test") == []
    with torch.no_grad():
        torch.testing.assert_close(same(x), src(x))


def test_apply_weights_lists_missing_and_unexpected_keys() -> None:
    net = tiny()
    state = dict(net.state_dict())
    state.pop("blocks.3.conv.0.0.weight")
    state["blocks.99.weight"] = torch.zeros(1)
    with pytest.raises(ModelError, match=r"from my.pt do not fit mobilenet_v2: missing keys: blocks\.3\.conv"
                                         r".*unexpected keys: blocks\.99\.weight"):
        apply_weights(net, state, source="my.pt")
    with pytest.raises(ModelError, match="missing keys: blocks.0.0.weight.*unexpected keys: blocks.0.conv1"):
        apply_weights(net, tiny(arch="resnet18").state_dict(), source="resnet file")
    wider = build_backbone("mobilenet_v2", 5, width_mult=0.5).state_dict()
    with pytest.raises(ModelError, match=r"shape mismatches: blocks\.\d+\.\S+ \(\d+, .*\) in file vs \("):
        apply_weights(net, wider, source="wide file")


def test_apply_weights_maps_torchvision_names(tmp_path: Path) -> None:
    import torchvision.models as tvm

    torch.manual_seed(7)
    ref = tvm.resnet18(weights=None, num_classes=4).eval()
    net = tiny(num_classes=4, arch="resnet18")
    net.blocks[0].conv1.stride, net.blocks[0].maxpool = (2, 2), ref.maxpool  # undo small_input
    apply_weights(net, ref.state_dict(), source="hub")
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(net(x), ref(x))


def test_hub_checkpoint_finds_cached_files_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path))
    assert hub_checkpoint("mobilenet_v2") is None
    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    (ckpt / "mobilenet_v3_small-047dcff4.pth").write_bytes(b"x")
    (ckpt / "efficientnet_b0_rwightman-7f5810bc.pth").write_bytes(b"x")
    assert hub_checkpoint("mobilenet_v2") is None
    (ckpt / "mobilenet_v2-b0353104.pth").write_bytes(b"x")
    assert hub_checkpoint("mobilenet_v2") == ckpt / "mobilenet_v2-b0353104.pth"
    assert hub_checkpoint("mobilenet_v3_small") == ckpt / "mobilenet_v3_small-047dcff4.pth"
    assert hub_checkpoint("efficientnet_b0") == ckpt / "efficientnet_b0_rwightman-7f5810bc.pth"
    assert hub_checkpoint("resnet18") is None


def test_hub_checkpoint_loads_into_blocknet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torchvision.models as tvm

    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path))
    (tmp_path / "checkpoints").mkdir()
    torch.manual_seed(3)
    ref = tvm.squeezenet1_1(weights=None, num_classes=1000).eval()
    torch.save(ref.state_dict(), tmp_path / "checkpoints" / "squeezenet1_1-b8a52dc0.pth")
    state, _ = load_weights(hub_checkpoint("squeezenet1_1"))
    net = build_backbone("squeezenet1_1", 6).eval()
    notes = apply_weights(net, state, source="hub")  # 1000-class head skipped for 6 target classes
    assert notes and "head.classifier.1" in notes[0]
    bottom_ref = nn.Sequential(*ref.features)
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(nn.Sequential(*net.blocks)(x), bottom_ref(x))
