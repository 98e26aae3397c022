"""Config: flags, then env, then defaults; every bad value names its setting."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from engine.protocol import default_model_path
from gateway.config import GatewayConfig, load_config
from gateway.ratelimit import KeyLimits, KeyRing, tenant_id
from gateway.settings import ConfigError

ENGINE = ["--engine", "http://127.0.0.1:9001"]


def test_defaults_spawn_one_engine_with_the_default_model():
    config = load_config([], environ={})
    assert config.spawn is not None and config.spawn.count == 1
    assert config.spawn.model == str(default_model_path())
    assert config.tokenizer == str(default_model_path())
    assert config.served_model_name is None  # the engines name their model
    assert "--served-model-name" not in config.spawn.argv("127.0.0.1", 9999, 0)
    assert (config.host, config.port, config.routing, config.index_url) == ("127.0.0.1", 8000, "prefix", "memory://")
    assert config.api_keys == () and not config.shared_prefix_cache and config.trusted_proxies == ()


def test_flags_and_env_with_flag_winning():
    env = {"KVGATE_PORT": "9000", "API_KEYS": "k1,k2", "KVGATE_ENGINES": "http://a:1,http://b:2/",
           "KVGATE_SHARED_PREFIX_CACHE": "true", "KVGATE_TRUSTED_PROXIES": "10.0.0.0/8"}
    config = load_config(["--port", "9100", "--api-key", "k3"], environ=env)
    assert config.port == 9100  # the flag wins over KVGATE_PORT
    assert config.api_keys == ("k3",)  # so does --api-key over API_KEYS
    assert config.engines == ("http://a:1", "http://b:2")
    assert config.spawn is None and config.served_model_name is None  # named by the engines' /stats
    assert config.shared_prefix_cache and config.trusted_proxies == ("10.0.0.0/8",)


def test_api_key_file_adds_keys_with_their_limits(tmp_path: Path):
    keys = tmp_path / "keys"
    keys.write_text("# ops keys\nsk-one\n\n  sk-two rps=2 tpm=600  \n")
    config = load_config([*ENGINE, "--api-key", "sk-zero", "--api-key-file", str(keys), "--rate-limit-rps", "5"],
                         environ={})
    assert config.api_keys == ("sk-zero",) and config.api_key_file == str(keys)
    assert "sk-" not in repr(config) and config.summary()["api_keys"] == 1
    ring = KeyRing(config.api_keys, config.api_key_file, config.key_limits)
    assert len(ring) == 3
    assert ring.lookup("sk-one").limits == KeyLimits(5.0, None)  # the default limits
    assert ring.lookup("sk-two").limits == KeyLimits(2.0, 600.0)
    assert ring.lookup("sk-zero").tenant == tenant_id("sk-zero") and ring.lookup("sk-three") is None
    keys.write_text("sk-one bogus=1\n")
    with pytest.raises(ConfigError, match="line 1: unknown option 'bogus=1'"):
        load_config([*ENGINE, "--api-key-file", str(keys)], environ={})


def test_passwords_stay_out_of_the_summary():
    config = load_config([*ENGINE, "--index-url", "redis://:s3cret@redis:6379/0"], environ={})
    assert "s3cret" not in str(config.summary()) and config.summary()["index_url"] == "redis://:***@redis:6379/0"
    assert config.rate_limit_url == "redis://:s3cret@redis:6379/0"  # the index's Redis by default


def test_spawn_flags_pass_through():
    config = load_config(["--spawn-engines", "2", "--model", "tiny", "--load-format", "dummy", "--device", "cuda",
                          "--block-size", "32", "--max-num-seqs", "8", "--engine-args", "--num-kv-blocks 64"],
                         environ={})
    assert config.served_model_name is None  # a dummy shape: the engine's name ("tiny") is used
    argv = config.spawn.argv("127.0.0.1", 9999, 1)
    assert argv[:4] == [sys.executable, "-m", "engine", "serve"]
    assert argv[argv.index("--device") + 1] == "cuda:1"  # engine i on GPU i
    assert argv[argv.index("--block-size") + 1] == "32" and argv[-2:] == ["--num-kv-blocks", "64"]
    assert argv[argv.index("--replica-id") + 1].endswith(":9999")  # unique per engine in a shared index
    assert "--dtype" not in argv and "--index-url" not in argv  # unset flags keep the engine's defaults


def test_spawned_engines_get_the_served_model_name():
    config = load_config(["--served-model-name", "my-model"], environ={})
    argv = config.spawn.argv("127.0.0.1", 9999, 0)
    assert config.served_model_name == "my-model" and argv[argv.index("--served-model-name") + 1] == "my-model"
    assert "--load-format" not in argv  # the engine's default


def test_dataclass_defaults_are_the_settings_defaults():
    loaded = load_config(ENGINE, environ={})  # all defaults but the engine URL and the resolved tokenizer
    assert loaded.cache_dir == GatewayConfig().cache_dir.expanduser()
    assert dataclasses.replace(loaded, engines=(), tokenizer="", cache_dir=GatewayConfig().cache_dir) == GatewayConfig()


def test_chat_template_file_is_read_at_start(tmp_path: Path):
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert load_config([*ENGINE, "--chat-template", str(template)], environ={}).chat_template == template.read_text()
    template.write_text("  \n")
    with pytest.raises(ConfigError, match="the file is empty"):
        load_config([*ENGINE, "--chat-template", str(template)], environ={})


def test_spawned_engines_publish_to_a_shared_index_only():
    redis = load_config(["--index-url", "redis://127.0.0.1:6379/3"], environ={}).spawn.argv("h", 1, 0)
    assert redis[redis.index("--index-url") + 1] == "redis://127.0.0.1:6379/3"
    assert "--index-url" not in load_config(["--index-url", "memory://"], environ={}).spawn.argv("h", 1, 0)
    cluster = "redis+cluster://:pw@10.0.0.1:6379,10.0.0.2:6379"
    argv = load_config(["--index-url", cluster], environ={}).spawn.argv("h", 1, 0)
    assert argv[argv.index("--index-url") + 1] == cluster
    assert load_config(["--index-url", cluster, "--engine", "http://e:1"], environ={}).index_url == cluster


@pytest.mark.parametrize("argv, env, named", [
    (["--port", "eighty"], {}, "--port='eighty': must be an integer"),
    ([], {"KVGATE_PORT": "70000"}, "KVGATE_PORT='70000': must be in [1, 65535]"),
    ([*ENGINE, "--engine", "ftp://x"], {}, "--engine='ftp://x'"),
    (["--routing", "random"], {}, "--routing='random'"),
    (["--index-url", "mysql://x"], {}, "--index-url='mysql://x'"),
    (["--root-path", "llm/"], {}, "--root-path='llm/'"),
    (["--trusted-proxies", "proxy.local"], {}, "--trusted-proxies='proxy.local'"),
    (["--api-key", "has space"], {}, "--api-key='<redacted>'"),
    ([], {"KVGATE_SHARED_PREFIX_CACHE": "maybe"}, "KVGATE_SHARED_PREFIX_CACHE='maybe'"),
    ([], {"KVGATE_LOG_LEVEL": "chatty"}, "KVGATE_LOG_LEVEL='chatty'"),
    (["--max-in-flight", "0"], {}, "--max-in-flight='0'"),
    (["--health-interval", "-1"], {}, "--health-interval='-1'"),
    (["--api-key-file", "/nonexistent/keys"], {}, "--api-key-file='/nonexistent/keys'"),
    (["--chat-template", "/nonexistent/t.jinja"], {}, "--chat-template='/nonexistent/t.jinja': cannot read it"),
    ([*ENGINE, "--spawn-engines", "2"], {}, "--engine and --spawn-engines exclude each other"),
    ([*ENGINE, "--model", "x.gguf"], {}, "--model only applies with --spawn-engines"),
    ([*ENGINE, "--served-model-name", "m"], {}, "--served-model-name only applies with --spawn-engines"),
])
def test_bad_values_name_the_setting(argv, env, named):
    with pytest.raises(ConfigError) as info:
        load_config(argv, environ=env)
    assert named in str(info.value)


def test_cli_exits_2_naming_the_flag():
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "gateway", "serve", "--port", "x"], capture_output=True, text=True,
                          cwd=Path(__file__).parents[2], timeout=60)
    assert proc.returncode == 2 and "--port='x': must be an integer" in proc.stderr


def test_env_lists_are_comma_separated_and_trimmed():
    assert load_config(ENGINE, environ={"API_KEYS": "k1, k2,"}).api_keys == ("k1", "k2")


def test_engine_dns_names_a_headless_service_and_excludes_spawning():
    config = load_config(["--engine-dns", "kvgate-engine.kvgate.svc:8100"], environ={})
    assert (config.engine_dns, config.spawn, config.engines) == (("kvgate-engine.kvgate.svc", 8100), None, ())
    assert load_config([], environ={"KVGATE_ENGINE_DNS": "e:1"}).engine_dns == ("e", 1)
    for bad in ("kvgate-engine", "kvgate-engine:http", ":8100", "e:0", "http://e:8100"):
        with pytest.raises(ConfigError, match="--engine-dns=.*NAME:PORT"):
            load_config(["--engine-dns", bad], environ={})
    with pytest.raises(ConfigError, match="--engine-dns and --spawn-engines exclude each other"):
        load_config(["--engine-dns", "e:1", "--spawn-engines", "2"], environ={})
    with pytest.raises(ConfigError, match="--model only applies with --spawn-engines"):
        load_config(["--engine-dns", "e:1", "--model", "x"], environ={})


def test_a_cluster_index_url_serves_every_redis_user():
    """The stored Responses conversations live where the index does: a cluster URL opens a cluster client."""
    from redis.asyncio import Redis
    from redis.asyncio.cluster import RedisCluster

    from gateway.response_store import make_response_store

    cluster = make_response_store("redis+cluster://:pw@127.0.0.1:7000,127.0.0.1:7001", 60)
    single = make_response_store("redis://127.0.0.1:6379/13", 60)
    assert isinstance(cluster._redis, RedisCluster) and isinstance(single._redis, Redis)
