"""Gateway test fixtures: the tokenizer, one tiny dummy engine with one gateway in front of it, and a
gateway that spawned one real SmolLM2 engine (for what only real weights and a vocabulary show:
constrained generation, served names).

Process fixtures are session-scoped so the suite stays fast on two shared cores.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from gw_harness import API_KEYS, CACHE_DIR, ENGINE_TOKEN, TINY_ENGINE_ARGS, Proc, start_engine, start_gateway

from engine.protocol import default_model_path
from gateway.tokenizer import Tokenizer, load_hf_tokenizer


@pytest.fixture(scope="session")
def hf_tokenizer():
    """The transformers tokenizer of the default model (GGUF converted once, then from the disk cache)."""
    return load_hf_tokenizer(str(default_model_path()), CACHE_DIR)


@pytest.fixture(scope="session")
def tokenizer(hf_tokenizer) -> Tokenizer:
    return Tokenizer(hf_tokenizer)


@pytest.fixture(scope="session")
def dummy_engine(tmp_path_factory) -> Iterator[Proc]:
    engine = start_engine(tmp_path_factory.mktemp("engine") / "engine.log", *TINY_ENGINE_ARGS)
    yield engine
    engine.stop()


@pytest.fixture(scope="session")
def gateway(dummy_engine: Proc, tmp_path_factory) -> Iterator[Proc]:
    """The gateway most tests use: two API keys, trusting 127.0.0.1 as a proxy, a tight body limit."""
    gw = start_gateway(
        tmp_path_factory.mktemp("gateway") / "gateway.log", "--engine", dummy_engine.url,
        "--api-key", API_KEYS[0], "--api-key", API_KEYS[1], "--trusted-proxies", "127.0.0.1",
        "--max-body-bytes", "65536", "--log-level", "DEBUG",
    )
    yield gw
    gw.stop()


@pytest.fixture(scope="session")
def smollm2_gateway(tmp_path_factory) -> Iterator[Proc]:
    """A gateway (no keys) that spawned one SmolLM2 engine: real weights, real vocabulary."""
    gw = start_gateway(tmp_path_factory.mktemp("smollm2") / "gateway.log", "--spawn-engines", "1",
                       "--engine-args", "--num-kv-blocks 512 --max-num-seqs 16",
                       env={"KVGATE_ENGINE_TOKEN": ENGINE_TOKEN})
    yield gw
    gw.stop()
