from __future__ import annotations

from pathlib import Path

import pytest

from gpuppetti.core.config import ConfigError, load_config, parse_config, resource_name_problem
from tests.helpers import TWO_M3_MAX, config_from

ISSUE_EXAMPLE = """\
version: v1
simulated:
  gpus:
    - {model: Apple M3 Max, vendor: apple, cores: 40, memory: 48Gi, count: 2}
sharing:
  timeSlicing:
    renameByDefault: false
    failRequestsGreaterThanOne: false
    resources:
      - name: apple.com/gpu
        replicas: 4
        # optional: rename: apple.com/gpu-shared
        # optional: devices: ["0"]
"""


def test_the_documented_example_loads() -> None:
    config = parse_config(ISSUE_EXAMPLE, "example.yaml")
    gpu = config.simulated.gpus[0]
    assert (gpu.model, gpu.vendor, gpu.cores, gpu.memory, gpu.count) == ("Apple M3 Max", "apple", 40, 48 * 2**30, 2)
    resource = config.sharing.time_slicing.resources[0]
    assert (resource.name, resource.replicas, resource.rename, resource.devices) == ("apple.com/gpu", 4, None, None)
    assert config.plugin.allocation_policy == "distributed"
    assert config.source == "example.yaml"


def _error(text: str) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        parse_config(text, "/etc/gpuppetti/config.yaml")
    return caught.value


@pytest.mark.parametrize(
    ("text", "key", "what"),
    [
        ("version: v1\nsharing:\n  timeslicing: {}\n", "sharing.timeslicing", "unknown key"),
        ("version: v1\nsimulated:\n  gpus:\n    - {model: X, colour: red}\n", "simulated.gpus[0].colour",
         "unknown key"),
        (TWO_M3_MAX.replace("replicas: 4", "replicas: '4'"), "sharing.timeSlicing.resources[0].replicas",
         "valid integer"),
        (TWO_M3_MAX.replace("replicas: 4", "replicas: 0"), "sharing.timeSlicing.resources[0].replicas",
         "greater than or equal to 1"),
        (TWO_M3_MAX.replace("48Gi", "48Gb"), "simulated.gpus[0].memory", "byte quantity"),
        (TWO_M3_MAX.replace("name: apple.com/gpu", "name: gpu"), "sharing.timeSlicing.resources[0].name",
         "not an extended resource name"),
        (TWO_M3_MAX.replace("cores: 40", "cores: forty"), "simulated.gpus[0].cores", "valid integer"),
        (TWO_M3_MAX.replace("backend: simulated", "backend: cuda"), "backend",
         "'auto', 'simulated', 'drm', 'nvml' or 'macos'"),
        (TWO_M3_MAX.replace("version: v1", "version: v2"), "version", "unsupported version 'v2'"),
        ("simulated: {gpus: []}\n", "version", "required key is missing"),
        (TWO_M3_MAX + "plugin: {allocationPolicy: random}\n", "plugin.allocationPolicy", "'distributed' or 'packed'"),
        ("version: v1\nsharing:\n  timeSlicing:\n    renameByDefault: 'yes'\n",
         "sharing.timeSlicing.renameByDefault", "valid boolean"),
    ],
)
def test_errors_name_the_file_the_key_and_the_problem(text: str, key: str, what: str) -> None:
    error = _error(text)
    message = str(error)
    assert message.startswith(f"/etc/gpuppetti/config.yaml: {key}: ")
    assert what in message
    assert len(message.splitlines()) == 1


def test_every_problem_is_reported() -> None:
    error = _error("version: v1\nsimulated:\n  gpus:\n    - {model: X, count: 0, cores: -1}\n")
    assert [path for path, _ in error.problems] == ["simulated.gpus[0].cores", "simulated.gpus[0].count"]


@pytest.mark.parametrize(
    ("text", "what"),
    [
        ("version: v1\nversion: v1\n", "duplicate key 'version'"),
        ("version: [v1\n", "not valid YAML"),
        ("", "the file is empty"),
        ("- version: v1\n", "expected a mapping"),
    ],
)
def test_malformed_files(text: str, what: str) -> None:
    message = str(_error(text))
    assert message.startswith("/etc/gpuppetti/config.yaml: ")
    assert what in message


def test_yaml_errors_say_where() -> None:
    assert "line 2, column 17" in str(_error("version: v1\nsimulated: {a: b]\n"))


def test_the_same_resource_twice_needs_devices() -> None:
    message = str(_error(TWO_M3_MAX + "      - {name: apple.com/gpu, replicas: 2}\n"))
    assert "sharing.timeSlicing: resource 'apple.com/gpu' is listed twice" in message


def test_empty_devices_list_is_an_error() -> None:
    message = str(_error(TWO_M3_MAX.replace("replicas: 4", "replicas: 4\n        devices: []")))
    assert "sharing.timeSlicing.resources[0]: devices: must list at least one GPU" in message


def test_devices_accept_indexes_and_ids() -> None:
    config = config_from(TWO_M3_MAX.replace("replicas: 4", "replicas: 4\n        devices: [0, sim-apple-1]"))
    assert config.sharing.time_slicing.resources[0].devices == [0, "sim-apple-1"]


def test_load_config_reads_files_and_reports_missing_ones(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(TWO_M3_MAX)
    assert load_config(path).source == str(path)
    with pytest.raises(ConfigError, match=r"missing\.yaml: cannot read the config file"):
        load_config(tmp_path / "missing.yaml")


def test_no_config_means_defaults() -> None:
    config = load_config(None)
    assert config.backend == "auto"
    assert config.simulated.gpus == []
    assert config.sharing.time_slicing.resources == []


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("apple.com/gpu", True),
        ("gpu.intel.com/i915", True),
        ("apple.com/gpu.shared", True),
        ("kubernetes.io/gpu", False),
        ("gpu.kubernetes.io/x", False),
        ("requests.example.com/gpu", False),
        ("gpu", False),
        ("Apple.com/gpu", False),
        ("apple.com/", False),
    ],
)
def test_resource_names(name: str, ok: bool) -> None:
    assert (resource_name_problem(name) is None) is ok
