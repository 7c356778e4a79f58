from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from gpuppetti.core.config import MAX_CONFIG_BYTES, ConfigError, load_config, parse_config, resource_name_problem
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


@pytest.mark.parametrize(("text", "key", "what"), [
    ("version: v1\nsharing:\n  timeSlicing:\n    resources:\n      - {name: apple.com/gpu, replica: 2}\n",
     "sharing.timeSlicing.resources[0].replica", "unknown key; did you mean replicas?"),
    ("version: v1\nsharing:\n  timeSlising: {}\n", "sharing.timeSlising", "unknown key; did you mean timeSlicing?"),
    ("version: v1\nbackends: drm\n", "backends", "unknown key; did you mean backend?"),
    ("version: v1\nsimulated:\n  gpus:\n    - {model: X, memroy: 8Gi}\n", "simulated.gpus[0].memroy",
     "unknown key; did you mean memory?"),
    ("version: v1\nzzz: 1\n", "zzz", "unknown key"),
])
def test_an_unknown_key_names_the_key_it_is_close_to(text: str, key: str, what: str) -> None:
    assert _error(text).problems == [(key, what)]


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


# A few hundred bytes whose aliases expand to 9**7 (4.8 million) strings where a backend's name should be: before
# the loader counted expansions, pydantic's complaint echoed all of them (hundreds of MiB, one line tens of MB).
ALIAS_BOMB = """\
version: v1
x-a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]
x-b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
x-c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
x-d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
x-e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]
x-f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]
x-g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]
backend: *g
"""


def test_an_alias_bomb_is_refused_in_one_line_with_bounded_memory(tmp_path: Path) -> None:
    assert len(ALIAS_BOMB) < 400
    (tmp_path / "bomb.yaml").write_text(ALIAS_BOMB)
    # Its own process, so that its peak resident memory is the parse's: after the imports, and at the end.
    script = (
        "import resource, sys\n"
        "from gpuppetti.core.config import ConfigError, load_config\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "try:\n"
        "    load_config(sys.argv[1])\n"
        "except ConfigError as exc:\n"
        "    print(str(exc))\n"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)\n"
    )
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path / "bomb.yaml")], capture_output=True,
                            text=True, timeout=120, check=True)
    *message, grown_mib = result.stdout.splitlines()
    assert len(message) == 1 and "aliases" in message[0] and "bomb.yaml" in message[0], message
    assert int(grown_mib) < 20


def test_a_few_aliases_are_fine() -> None:
    config = parse_config("version: v1\nsimulated:\n  gpus:\n    - &m3 {model: M3, vendor: apple, cores: 10}\n"
                          "    - *m3\n", "aliases.yaml")
    assert [gpu.model for gpu in config.simulated.gpus] == ["M3", "M3"]


def test_a_recursive_alias_is_refused() -> None:
    with pytest.raises(ConfigError, match="aliases"):
        parse_config("version: v1\nbackend: &loop [*loop]\n", "loop.yaml")


def test_an_error_echoes_a_bounded_part_of_the_input() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(f"version: v1\nbackend: [{', '.join(['x' * 1000] * 1000)}]\n", "long.yaml")
    [line] = str(caught.value).splitlines()
    assert line.startswith("long.yaml: backend: ") and "(got [" in line
    assert len(line) < 400


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    outcome: list[ConfigError | None] = []

    def load() -> None:
        try:
            load_config(fifo)
            outcome.append(None)
        except ConfigError as exc:
            outcome.append(exc)

    reader = threading.Thread(target=load, daemon=True)
    reader.start()
    reader.join(timeout=10)
    if reader.is_alive():
        # Let the blocked reader go: a writer opens, and closes at once.
        os.close(os.open(fifo, os.O_WRONLY))
        reader.join(timeout=10)
        pytest.fail("reading a FIFO blocked until a writer came")
    [error] = outcome
    assert isinstance(error, ConfigError)
    assert str(error) == f"{fifo}: the config must be a regular file, and this is a FIFO"


def test_a_directory_and_a_file_too_large_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="must be a regular file, and this is a directory"):
        load_config(tmp_path)
    large = tmp_path / "large.yaml"
    large.write_text("version: v1\n" + "#" * MAX_CONFIG_BYTES + "\n")
    with pytest.raises(ConfigError, match="larger than 1,048,576 bytes"):
        load_config(large)
