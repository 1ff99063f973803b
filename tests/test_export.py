"""save_subnet / load_subnet: a frozen subnet as a folder that loads with torch alone, bitwise."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lightning_naspipe as lnp
from lightning_naspipe.searching.export import load_architecture
from test_freezing import SPACES, _architectures, _trained

# Runs in a fresh interpreter where this library and the tests' own classes cannot be imported.
LOAD_WITH_TORCH_ONLY = """
import sys
for name in ("lightning_naspipe", "helpers", "test_freezing", "test_cells", "lightning", "pytorch_lightning"):
    sys.modules[name] = None  # any import of them fails
import torch
torch.set_num_threads(1)
folder, inputs = sys.argv[1], torch.load(sys.argv[2])
module = torch.export.load(folder + "/program.pt2").module()
torch.save([module(x) for x in inputs], sys.argv[3])
"""


@pytest.mark.parametrize("name", list(SPACES))
def test_saved_subnet_loads_with_torch_alone_and_equals_the_supernet_bitwise(name: str, tmp_path: Path) -> None:
    supernet, x = _trained(name)
    supernet.eval()
    arch = _architectures(supernet, 1, seed=4)[0]
    folder = lnp.save_subnet(supernet.freeze(arch), tmp_path / "subnet", x)
    assert load_architecture(folder) == arch
    smaller = x[:2]  # another batch size: the batch dimension is exported as dynamic where possible
    torch.save([x, smaller], tmp_path / "inputs.pt")
    subprocess.run([sys.executable, "-c", LOAD_WITH_TORCH_ONLY, str(folder), str(tmp_path / "inputs.pt"),
                    str(tmp_path / "outputs.pt")], check=True, capture_output=True, timeout=120)
    outputs = torch.load(tmp_path / "outputs.pt")
    with torch.no_grad():
        assert torch.equal(outputs[0], supernet(x, arch))
        if json.loads((folder / "architecture.json").read_text())["dynamic_batch"]:
            assert torch.equal(outputs[1], supernet(smaller, arch))
    in_process = lnp.load_subnet(folder)
    with torch.no_grad():
        assert torch.equal(in_process(x), supernet(x, arch))
    weights = torch.load(folder / "weights.pt")
    assert all(torch.equal(weights[k], v) for k, v in supernet.freeze(arch).state_dict().items())


def test_saving_again_replaces_the_folder_and_a_failed_save_keeps_the_old_one(tmp_path: Path) -> None:
    supernet, x = _trained("toy")
    first, second = _architectures(supernet, 2, seed=5)
    folder = lnp.save_subnet(supernet.freeze(first), tmp_path / "subnet", x)
    (folder / "stale.txt").write_text("left from before")
    lnp.save_subnet(supernet.freeze(second), folder, x)
    assert load_architecture(folder) == second and not (folder / "stale.txt").exists()
    with pytest.raises(lnp.NASPipeConfigError, match="cannot export"):
        lnp.save_subnet(supernet.freeze(first), folder, "not an input")
    assert load_architecture(folder) == second
    assert sorted(p.name for p in tmp_path.iterdir()) == ["subnet"]  # no staging folder left


def test_loading_a_folder_without_a_program_says_how_to_write_one(tmp_path: Path) -> None:
    with pytest.raises(lnp.NASPipeConfigError, match="save_subnet"):
        lnp.load_subnet(tmp_path)
