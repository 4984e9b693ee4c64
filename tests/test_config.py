"""Config loading: TOML keys, flag overrides, and clear errors that name the key and the file."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stream import config
from stream.config import Config, SourceSpec
from stream.errors import ConfigError


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.toml"
    p.write_text(text)
    return p


def test_defaults_are_safe() -> None:
    cfg = config.load()
    assert cfg.publish == "tcp://127.0.0.1:5556"  # loopback only unless configured
    assert cfg.device == "auto" and cfg.buffers == 3 and cfg.format == "json"
    assert cfg.sources == ()


def test_file_then_flags_override(tmp_path: Path) -> None:
    p = write(tmp_path, 'device = "cpu"\nbuffers = 3\nsources = ["a.mp4", {id = "cam", path = "b.mp4"}]\n')
    cfg = config.load(p, {"buffers": 1, "device": None})
    assert cfg.device == "cpu" and cfg.buffers == 1
    assert cfg.sources == (SourceSpec(None, "a.mp4"), SourceSpec("cam", "b.mp4"))
    assert cfg.config_path == p
    cfg = config.load(p, {"sources": ["x=c.mp4"]})
    assert cfg.sources == (SourceSpec("x", "c.mp4"),)


@pytest.mark.parametrize(
    "text, words",
    [
        ("colour = 1\n", ["'colour'", "c.toml", "known keys"]),
        ('device = "tpu"\n', ["'device'", "c.toml", "auto, cpu, cuda"]),
        ("buffers = 0\n", ["'buffers'", "between 1 and 8"]),
        ('buffers = "2"\n', ["'buffers'", "must be int"]),
        ("wait_subscribers = true\n", ["'wait_subscribers'", "must be int"]),
        ('publish = "127.0.0.1:5556"\n', ["'publish'", "tcp://"]),
        ('sources = [{id = "a", file = "x.mp4"}]\n', ["'file'", "sources[0]"]),
        ('sources = [{id = "a"}]\n', ["sources[0]", "'path'"]),
        ("sources = 3\n", ["'sources'", "list"]),
        ("device = \n", ["not valid TOML"]),
        ('conv_algo_search = "fast"\n', ["'conv_algo_search'", "auto, exhaustive, heuristic, default"]),
    ],
)
def test_bad_values_name_key_and_file(tmp_path: Path, text: str, words: list[str]) -> None:
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        config.load(p)
    for w in words:
        assert w in str(err.value), (w, str(err.value))
    if "TOML" not in words[0]:
        assert str(p) in str(err.value)


def test_bad_flag_names_the_command_line() -> None:
    with pytest.raises(ConfigError, match="'buffers' on the command line"):
        config.load(None, {"buffers": 99})


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        config.load(tmp_path / "nope.toml")


@pytest.mark.parametrize(
    "text, spec",
    [
        ("a.mp4", SourceSpec(None, "a.mp4")),
        ("cam=a.mp4", SourceSpec("cam", "a.mp4")),
        ("rtsp://u:p@h/s?x=1", SourceSpec(None, "rtsp://u:p@h/s?x=1")),
        ("cam=rtsp://h/s?x=1", SourceSpec("cam", "rtsp://h/s?x=1")),
    ],
)
def test_parse_source(text: str, spec: SourceSpec) -> None:
    assert config.parse_source(text) == spec


ROOT = Path(__file__).resolve().parent.parent


def test_shipped_configs_load() -> None:
    """Every configs/*.toml loads: each of its keys is a known key (load rejects any other) with a valid value."""
    files = sorted((ROOT / "configs").glob("*.toml"))
    assert files, "configs/ has no TOML files"
    for f in files:
        assert isinstance(config.load(f), Config)


def test_default_config_lists_every_key_with_its_default() -> None:
    """configs/default.toml is the documented full file: each key set to its default, or, where TOML cannot
    write the default (model and devices unset), shown commented out."""
    from stream.tools.config_docs import toml_literal

    path = ROOT / "configs" / "default.toml"
    text, data = path.read_text(), config.read_toml(path)
    for key, about in config.KEYS.items():
        if key in data:
            assert config.check_value(key, data[key], str(path)) == about.default, f"{key} is not its default in {path}"
        else:
            assert about.unset, f"{key} is missing from {path}: add `{key} = {toml_literal(about.default)}`"
            assert f"# {key} =" in text, f"{key} (unset by default) is not shown commented out in {path}"


def test_docs_are_generated_from_the_keys() -> None:
    from stream.tools.config_docs import COMMAND, render

    path = ROOT / "docs" / "configuration.md"
    assert path.exists() and path.read_text() == render(), f"{path} is out of date: run `{COMMAND}`"


def test_every_field_is_a_described_key() -> None:
    assert set(config.KEYS) | {"config_path"} == {f.name for f in fields(Config)}
    for about in config.KEYS.values():
        assert about.help.endswith("."), f"{about.name}: the help is a sentence for users (it ends with a period)"


def test_run_flags_are_the_keys_flags() -> None:
    """The flags of `stream run` (a public surface: names, old names, metavars, choices) come from the keys."""
    import argparse

    from stream.daemon.cli import _add_run

    sub = argparse.ArgumentParser(prog="stream").add_subparsers()
    _add_run(sub)
    run = sub.choices["run"]
    options = run._option_string_actions  # argparse has no public map of a parser's options
    assert set(options) == {
        "-h",
        "--help",
        "--config",
        "--source",
        "--model",
        "--device",
        "--device-id",
        "--devices",
        "--live-workers",
        "--publish",
        "--format",
        "--wait-subscribers",
        "--buffers",
        "--duration",
        "--loop",
        "--annotate",
        "--http-port",
        "--metrics-port",
        "--control",
        "--curve-secret",
        "--curve-clients",
        "--progress",
        "--log-level",
        "--log-format",
        "--shard",
        "--detect-fps",
    }
    for key, about in config.KEYS.items():
        if about.flag is not None:
            assert all(options[name].dest == key for name in about.flag.names), key
    args = run.parse_args(
        [
            "--source",
            "a.mp4",
            "--source",
            "x=b.mp4",
            "--duration",
            "2.5",
            "--annotate",
            "out",
            "--metrics-port",
            "8080",
            "--control",
            "--devices",
            "cpu,cpu",
            "--device-id",
            "1",
            "--detect-fps",
            "7.5",
        ]
    )
    assert args.sources == ["a.mp4", "x=b.mp4"] and args.duration_s == 2.5 and args.annotate_dir == "out"
    assert args.metrics_port == 8080 and args.control == "tcp://127.0.0.1:5557" and args.devices == ["cpu", "cpu"]
    assert args.detect_fps == 7.5
    assert args.device_id == 1 and args.loop is None and args.format is None  # not given: the file's value stands
    assert options["--device"].choices == config.DEVICES and options["--format"].choices == ("json", "msgpack")


def test_a_worker_gets_the_supervisors_config_with_its_own_keys_fixed() -> None:
    from stream.daemon.supervisor import _worker_config

    cfg = config.load(
        None,
        {
            "devices": ["cpu", "cpu"],
            "progress": "on",
            "wait_subscribers": 2,
            "duration_s": 5,
            "publish_hwm": 7,
            "buffers": 2,
            "curve_secret": "s",
            "curve_clients": "c",
        },
    )
    w = _worker_config(cfg, "cpu", "ipc:///tmp/w0")
    assert (w.publish, w.device, w.device_id, w.devices) == ("ipc:///tmp/w0", "cpu", 0, ())
    assert (w.progress, w.wait_subscribers, w.duration_s, w.publish_hwm) == ("off", 0, 0.0, 0)
    assert (w.curve_secret, w.curve_clients, w.control, w.metrics_port, w.annotate_dir) == ("", "", "", 0, "")
    assert w.buffers == 2 and w.cpu_threads >= 1  # the rest is the supervisor's; the cores shared out
    gpu = _worker_config(config.load(None, {"devices": [0, 1], "device": "cuda", "cpu_threads": 3}), 1, "ipc:///w1")
    assert (gpu.device, gpu.device_id, gpu.cpu_threads) == ("cuda", 1, 3)


def test_formats_are_the_wire_formats() -> None:
    from stream import messages

    assert config.FORMATS is messages.FORMATS


# -- property tests: any valid file loads to exactly its values; any unknown key is named ------------------

VALID = {
    "device": st.sampled_from(config.DEVICES),
    "format": st.sampled_from(config.FORMATS),
    "buffers": st.integers(1, 8),
    "queue_batches": st.integers(1, 64),
    "wait_subscribers": st.integers(0, 10_000),
    "linger_s": st.floats(0, 3600, allow_nan=False),
    "loop": st.booleans(),
    "metrics_port": st.integers(0, 65_535),
    "log_level": st.sampled_from(config.LOG_LEVELS),
    "publish": st.from_regex(r"tcp://127\.0\.0\.1:[1-9][0-9]{3}", fullmatch=True),
}


def toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\\\", "\\\\\\\\").replace('"', '\\\\"') + '"'
    return repr(v)


@given(st.fixed_dictionaries({}, optional=VALID))
def test_any_valid_config_loads_to_its_values(tmp_path_factory: pytest.TempPathFactory, values: dict) -> None:
    p = tmp_path_factory.mktemp("cfg") / "c.toml"
    p.write_text("".join(f"{k} = {toml_value(v)}\n" for k, v in values.items()))
    cfg = config.load(p)
    for k, v in values.items():
        assert getattr(cfg, k) == v


@given(st.from_regex(r"[a-z][a-z_]{0,20}", fullmatch=True).filter(lambda k: k not in config.known_keys()))
def test_any_unknown_key_is_named(tmp_path_factory: pytest.TempPathFactory, key: str) -> None:
    p = tmp_path_factory.mktemp("cfg") / "c.toml"
    p.write_text(f"{key} = 1\n")
    with pytest.raises(ConfigError) as err:
        config.load(p)
    assert f"'{key}'" in str(err.value) and str(p) in str(err.value)


def test_conv_algo_search_auto_follows_the_batch_axis(model_info: object) -> None:
    """auto: cuDNN's heuristic choice for dynamic-batch models (a new shape per partial batch size), the
    exhaustive search for fixed-batch ones (one shape); an explicit setting is passed on as ORT spells it."""
    from dataclasses import replace

    from stream.engines.cuda import conv_algo_choice

    fixed = replace(model_info, dynamic_batch=False)  # type: ignore[type-var]
    dynamic = replace(model_info, dynamic_batch=True)  # type: ignore[type-var]
    assert conv_algo_choice("auto", fixed) == "EXHAUSTIVE"
    assert conv_algo_choice("auto", dynamic) == "HEURISTIC"
    assert conv_algo_choice("exhaustive", dynamic) == "EXHAUSTIVE" and conv_algo_choice("default", fixed) == "DEFAULT"
    assert config.load(None, {"conv_algo_search": "heuristic"}).conv_algo_search == "heuristic"
    with pytest.raises(ValueError, match="conv_algo_search"):
        conv_algo_choice("fast", fixed)


def test_cuda_graph_auto_is_for_head_models_of_a_fixed_batch(model_info: object) -> None:
    """auto: a CUDA graph where ORT can replay one (a head model whose batch is fixed, by the session under
    pad_partial or in the file); "on" where it cannot is a clear error naming the model and the way out;
    "off" (the default) never; anything else is refused by the config, naming the key."""
    from dataclasses import replace

    from stream.engines.cuda import cuda_graph_choice
    from stream.engines.postprocess import HeadSpec, Level
    from stream.errors import ModelError

    spec = HeadSpec(
        cls="c", reg="r", num_classes=3, image_size=(64, 96), levels=(Level((8, 12), (8, 8), (16.0,), (1.0,)),)
    )
    head_dyn = replace(model_info, head=spec, dynamic_batch=True)  # type: ignore[type-var]
    head_fixed = replace(model_info, head=spec, dynamic_batch=False)  # type: ignore[type-var]
    graph_pp = replace(model_info, head=None)  # type: ignore[type-var]
    assert cuda_graph_choice("auto", head_dyn, "batch") is True  # the session fixes the axis (pad_partial)
    assert cuda_graph_choice("auto", head_fixed, None) is True
    assert cuda_graph_choice("auto", head_dyn, None) is False  # pad_partial = false: shapes change
    assert cuda_graph_choice("auto", graph_pp, None) is False
    assert cuda_graph_choice("off", head_fixed, None) is False and cuda_graph_choice("on", head_fixed, None) is True
    with pytest.raises(ModelError, match="--postprocess device"):
        cuda_graph_choice("on", graph_pp, None)
    with pytest.raises(ModelError, match="pad_partial"):
        cuda_graph_choice("on", head_dyn, None)
    assert config.load(None, {}).cuda_graph == "auto"  # measured end to end on the H200, 2026-12-06
    assert config.load(None, {"cuda_graph": "auto"}).cuda_graph == "auto"
    with pytest.raises(ConfigError, match="cuda_graph"):
        config.load(None, {"cuda_graph": "yes"})


def test_pad_partial_is_on_by_default_and_takes_booleans_only() -> None:
    assert config.load(None, {}).pad_partial is True
    assert config.load(None, {"pad_partial": False}).pad_partial is False
    with pytest.raises(ConfigError, match="pad_partial"):
        config.load(None, {"pad_partial": "yes"})
