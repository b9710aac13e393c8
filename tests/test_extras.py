"""Each extra-only command and option stops in one line naming its extra when the extra is not installed."""

import sys

import pytest

from vlfit import cli
from vlfit.errors import MissingExtraError
from vlfit.extras import COMMAND_EXTRAS, EXTRAS, missing_modules, require_extra


def _hide(monkeypatch, *modules):
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)  # import and find_spec now fail for it


def test_every_extra_is_installed_here_and_hiding_a_module_makes_it_missing(monkeypatch):
    for extra in EXTRAS:
        assert missing_modules(extra) == [], extra
    _hide(monkeypatch, "onnxruntime")
    assert missing_modules("export") == ["onnxruntime"]


@pytest.mark.parametrize("command", sorted(COMMAND_EXTRAS))
def test_a_command_without_its_extra_stops_in_one_line(monkeypatch, capsys, command):
    extra = COMMAND_EXTRAS[command]
    _hide(monkeypatch, *EXTRAS[extra])
    assert cli.main([command, "--help"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"vlfit {command}: error: vlfit {command} needs the {extra} extra ({', '.join(EXTRAS[extra])} not installed): "
        f"pip install 'vlfit[{extra}]'"
    ]


def test_lora_without_peft_is_refused_before_anything_runs(monkeypatch):
    from vlfit.arguments import ModelArguments

    _hide(monkeypatch, "peft")
    with pytest.raises(MissingExtraError, match=r"--lora_r \(LoRA adapters\) needs the lora extra"):
        ModelArguments(model_preset="tiny", lora_r=4)


def test_an_exported_backend_without_its_runtime_names_the_extra(monkeypatch):
    _hide(monkeypatch, "openvino")
    with pytest.raises(MissingExtraError, match=r"the openvino backend needs the export extra \(openvino not"):
        require_extra("export", "the openvino backend", ("openvino",))


def test_the_lock_pins_every_dependency_at_the_installed_version():
    import re
    from importlib.metadata import version
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    root = Path(__file__).resolve().parents[1]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    pins = dict(line.split("==", 1) for line in (root / "requirements/ci.txt").read_text().splitlines() if "==" in line)
    pins = {re.sub(r"[-_.]+", "-", name).lower(): pin for name, pin in pins.items()}
    wanted = list(project["dependencies"])
    for names in project["optional-dependencies"].values():
        wanted += [n for n in names if not n.startswith("vlfit")]
    for requirement in wanted:
        name = re.sub(r"[-_.]+", "-", re.split(r"[<>=!~\[ ]", requirement)[0]).lower()
        assert name in pins, f"{name} is not pinned in requirements/ci.txt"
        assert version(name) == pins[name], f"{name}: installed {version(name)}, pinned {pins[name]}"
    assert pins["torch"] == "2.14.1" and pins["torchvision"] == "0.29.1"
